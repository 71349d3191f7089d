//! The rendezvous: rank 0 listens on `MASTER_ADDR:MASTER_PORT`, every other rank connects once
//! and keeps its connection for the run. Every exchange is a gather to rank 0, a combination in
//! rank order there, and a broadcast of the result (or of one error, so that every rank fails
//! with the same message). It carries what is small or CPU-only: the start-up checks, NCCL's
//! unique id, the loss of a step, and the gradients of a CPU run (a sum in rank order: the same
//! bits on every rank, every run).
//!
//! Every message names its collective: a rank in another collective than rank 0 is an error
//! naming both, never a mixed-up payload. Reads and connections time out (`FERRITE_DIST_TIMEOUT`)
//! with the silent rank named.

use crate::core::error::{Error, Result};
use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Rank 0 refuses a frame longer than this (a stray connection, not a ferrite rank).
const MAX_FRAME: u64 = 1 << 40;

/// One process's end of the rendezvous.
pub(crate) struct Store {
    rank: usize,
    world: usize,
    /// Rank 0: the connection to rank r at index r (index 0 unused). Other ranks: rank 0's at 0.
    links: Vec<Option<TcpStream>>,
    timeout: Duration,
}

fn err(msg: String) -> Error {
    Error::Other(format!("dist: {msg}"))
}

fn write_frame(s: &TcpStream, tag: &str, payload: &[u8]) -> std::io::Result<()> {
    let mut w = std::io::BufWriter::new(s);
    w.write_all(&(tag.len() as u32).to_le_bytes())?;
    w.write_all(tag.as_bytes())?;
    w.write_all(&(payload.len() as u64).to_le_bytes())?;
    w.write_all(payload)?;
    w.flush()
}

fn read_exact(mut s: &TcpStream, n: u64) -> std::io::Result<Vec<u8>> {
    if n > MAX_FRAME {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            format!("a frame of {n} bytes"),
        ));
    }
    let mut v = vec![0u8; n as usize];
    s.read_exact(&mut v)?;
    Ok(v)
}

fn read_frame(mut s: &TcpStream) -> std::io::Result<(String, Vec<u8>)> {
    let mut n4 = [0u8; 4];
    s.read_exact(&mut n4)?;
    let tag_len = u32::from_le_bytes(n4) as u64;
    if tag_len > 4096 {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            format!("a collective name of {tag_len} bytes"),
        ));
    }
    let tag = String::from_utf8_lossy(&read_exact(s, tag_len)?).into_owned();
    let mut n8 = [0u8; 8];
    s.read_exact(&mut n8)?;
    let payload = read_exact(s, u64::from_le_bytes(n8))?;
    Ok((tag, payload))
}

impl Store {
    /// Joins the rendezvous of `world` ranks at `addr:port` as `rank`.
    pub(crate) fn connect(
        rank: usize,
        world: usize,
        addr: &str,
        port: u16,
        timeout: Duration,
    ) -> Result<Store> {
        let deadline = Instant::now() + timeout;
        let mut links: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        if rank == 0 {
            let listener = TcpListener::bind((addr, port))
                .map_err(|e| err(format!("rank 0 cannot listen on {addr}:{port}: {e}")))?;
            listener
                .set_nonblocking(true)
                .map_err(|e| err(format!("rank 0: {e}")))?;
            let mut joined = 1;
            while joined < world {
                match listener.accept() {
                    Ok((s, _)) => {
                        s.set_nonblocking(false)
                            .and_then(|_| s.set_read_timeout(Some(timeout)))
                            .and_then(|_| s.set_nodelay(true))
                            .map_err(|e| err(format!("rank 0: {e}")))?;
                        let (tag, hello) = match read_frame(&s) {
                            Ok(f) => f,
                            Err(_) => continue, // not a ferrite rank (a port scan): ignore
                        };
                        if tag != "hello" || hello.len() != 16 {
                            continue;
                        }
                        let r = u64::from_le_bytes(hello[..8].try_into().unwrap()) as usize;
                        let w = u64::from_le_bytes(hello[8..].try_into().unwrap()) as usize;
                        let refuse = if w != world {
                            Some(format!(
                                "rank {r} was started with WORLD_SIZE {w}, rank 0 with {world}"
                            ))
                        } else if r == 0 || r >= world {
                            Some(format!("a rank numbered {r} joined a world of {world}"))
                        } else if links[r].is_some() {
                            Some(format!("two processes joined as rank {r}"))
                        } else {
                            None
                        };
                        if let Some(m) = refuse {
                            let _ = write_frame(&s, "error", m.as_bytes());
                            return Err(err(m));
                        }
                        links[r] = Some(s);
                        joined += 1;
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        if Instant::now() > deadline {
                            let missing: Vec<usize> =
                                (1..world).filter(|&r| links[r].is_none()).collect();
                            return Err(err(format!(
                                "rank 0 waited {} s on {addr}:{port} and ranks {missing:?} never joined \
                                 (not started, or started with another MASTER_ADDR/MASTER_PORT); \
                                 FERRITE_DIST_TIMEOUT sets the wait",
                                timeout.as_secs()
                            )));
                        }
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    Err(e) => return Err(err(format!("rank 0: accepting on {addr}:{port}: {e}"))),
                }
            }
            // Everyone is in: tell each rank so (their hello is answered).
            for s in links.iter().flatten() {
                write_frame(s, "welcome", &[]).map_err(|e| err(format!("rank 0: {e}")))?;
            }
        } else {
            let target = (addr, port)
                .to_socket_addrs()
                .map_err(|e| err(format!("rank {rank}: MASTER_ADDR {addr}:{port}: {e}")))?
                .next()
                .ok_or_else(|| err(format!("rank {rank}: {addr}:{port} resolves to nothing")))?;
            let s = loop {
                match TcpStream::connect_timeout(&target, Duration::from_millis(500)) {
                    Ok(s) => break s,
                    Err(e) => {
                        if Instant::now() > deadline {
                            return Err(err(format!(
                                "rank {rank} could not reach rank 0 at {addr}:{port} within {} s: {e}",
                                timeout.as_secs()
                            )));
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                }
            };
            s.set_read_timeout(Some(timeout))
                .and_then(|_| s.set_nodelay(true))
                .map_err(|e| err(format!("rank {rank}: {e}")))?;
            let mut hello = (rank as u64).to_le_bytes().to_vec();
            hello.extend_from_slice(&(world as u64).to_le_bytes());
            write_frame(&s, "hello", &hello).map_err(|e| err(format!("rank {rank}: {e}")))?;
            let (tag, msg) = read_frame(&s).map_err(|e| {
                err(format!(
                    "rank {rank}: no welcome from rank 0 at {addr}:{port}: {e}"
                ))
            })?;
            if tag == "error" {
                return Err(err(String::from_utf8_lossy(&msg).into_owned()));
            }
            links[0] = Some(s);
        }
        Ok(Store {
            rank,
            world,
            links,
            timeout,
        })
    }

    fn io_error(&self, peer: usize, op: &str, e: std::io::Error) -> Error {
        let me = self.rank;
        match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => err(format!(
                "rank {me}: nothing from rank {peer} within {} s in '{op}' (it hangs, or waits in \
                 another collective); FERRITE_DIST_TIMEOUT sets the wait",
                self.timeout.as_secs()
            )),
            ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset | ErrorKind::BrokenPipe => {
                err(format!(
                    "rank {me}: rank {peer} closed its connection in '{op}' (it exited or failed)"
                ))
            }
            _ => err(format!("rank {me}: talking to rank {peer} in '{op}': {e}")),
        }
    }

    /// Every rank's `payload` meets at rank 0, which `combine`s them (in rank order) into one
    /// result that every rank returns; an error from `combine` is every rank's error.
    pub(crate) fn exchange(
        &self,
        op: &str,
        payload: &[u8],
        combine: impl FnOnce(&[Vec<u8>]) -> std::result::Result<Vec<u8>, String>,
    ) -> Result<Vec<u8>> {
        if self.rank == 0 {
            let mut all = Vec::with_capacity(self.world);
            all.push(payload.to_vec());
            let mut failure = None;
            for r in 1..self.world {
                let s = self.links[r].as_ref().expect("rank 0 holds every link");
                let (tag, p) = read_frame(s).map_err(|e| self.io_error(r, op, e))?;
                if tag != op && failure.is_none() {
                    failure = Some(format!(
                        "ranks disagree on the collective: rank 0 is in '{op}', rank {r} in '{tag}'"
                    ));
                }
                all.push(p);
            }
            let out = match failure {
                Some(f) => Err(f),
                None => combine(&all),
            };
            let (tag, body) = match &out {
                Ok(b) => ("ok", b.as_slice()),
                Err(m) => ("error", m.as_bytes()),
            };
            for r in 1..self.world {
                let s = self.links[r].as_ref().expect("rank 0 holds every link");
                write_frame(s, tag, body).map_err(|e| self.io_error(r, op, e))?;
            }
            out.map_err(err)
        } else {
            let s = self.links[0].as_ref().expect("a rank holds rank 0's link");
            write_frame(s, op, payload).map_err(|e| self.io_error(0, op, e))?;
            let (tag, body) = read_frame(s).map_err(|e| self.io_error(0, op, e))?;
            if tag == "error" {
                return Err(err(String::from_utf8_lossy(&body).into_owned()));
            }
            Ok(body)
        }
    }
}
