//! Property tests (proptest) over what user input reaches first: the shard header and index
//! parsers, the layout/stride arithmetic, views of a tensor's storage, and the string parsers
//! behind the CLI flags. Each property: any input gives a value or a clear error — never a
//! panic, an overflow, or a view outside its storage.
//!
//! CI runs proptest's default 256 cases per property; a long run:
//! `PROPTEST_CASES=200000 cargo test -p ferrite fuzz_tests` (a debug build: overflow checks on).

use crate::core::device::{Arch, Device};
use crate::core::dtype::DType;
use crate::core::layout::Layout;
use crate::core::tensor::Tensor;
use crate::data::format::{encode_ftok_header, encode_header, parse_header, Index, ShardFormat};
use proptest::prelude::*;
use std::path::Path;

fn dims() -> impl Strategy<Value = Vec<(usize, usize)>> {
    // (size, stride) pairs: small, huge, zero and the overflow edges.
    let v = prop_oneof![
        0usize..6,
        Just(1usize << 31),
        Just(usize::MAX / 2),
        Just(usize::MAX),
        any::<usize>()
    ];
    prop::collection::vec((v.clone(), v), 0..5)
}

proptest! {
    #[test]
    fn shard_headers_parse_or_refuse(bytes in prop::collection::vec(any::<u8>(), 0..5000), extra in any::<u64>()) {
        let _ = parse_header(Path::new("fuzz.bin"), &bytes, bytes.len() as u64 + (extra % 1_000_000));
        let _ = parse_header(Path::new("fuzz.bin"), &bytes, extra);
    }

    #[test]
    fn a_valid_header_with_a_flipped_byte_is_refused_or_unchanged(
        tokens in 0u64..1_000_000, at in 0usize..4096, bit in 0u8..8, u32tok in any::<bool>(),
    ) {
        let dt = if u32tok { DType::U32 } else { DType::U16 };
        let h = encode_ftok_header(dt, tokens, 7, 50257, 1 << 20);
        let file = h.len() as u64 + tokens * dt.size_in_bytes() as u64;
        let ok = parse_header(Path::new("x.ftok"), &h, file).expect("the encoded header parses");
        prop_assert_eq!(ok.tokens, tokens);
        let mut bad = h.clone();
        bad[at] ^= 1 << bit;
        if let Ok(p) = parse_header(Path::new("x.ftok"), &bad, file) {
            // Only bytes the header's CRC does not cover (and that mean nothing) may change.
            prop_assert_eq!(p.tokens, tokens);
        }
        for f in [ShardFormat::LlmcV1, ShardFormat::LlmcV7] {
            let l = encode_header(f, tokens, 0, 50257, 0);
            let _ = parse_header(Path::new("x.bin"), &l, l.len() as u64 + tokens * 2);
        }
    }

    #[test]
    fn indexes_parse_or_refuse(
        tokens in prop::collection::vec(prop_oneof![0u64..1000, Just(u64::MAX / 2 + 1), any::<u64>()], 0..4),
        total in prop_oneof![0u64..3000, any::<u64>()],
        chunk in prop_oneof![Just(1u64 << 20), any::<u64>()],
        cut in any::<usize>(),
    ) {
        let shards: Vec<String> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| format!(
                r#"{{"file":"s{i}.ftok","format":"ferrite","dtype":"u16","tokens":{t},"bytes":0,"payload_offset":4096,"crc32":0,"chunk_crc32":[]}}"#
            ))
            .collect();
        let text = format!(
            r#"{{"format":"ferrite-token-index","version":1,"tokenizer":"gpt2","vocab_size":50257,"eot_token":null,"chunk_bytes":{chunk},"total_tokens":{total},"shards":[{}]}}"#,
            shards.join(",")
        );
        let dir = std::env::temp_dir().join(format!("ferrite-fuzz-index-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("index-{}.json", cut % 7));
        // Whole, and cut short at a random byte (a torn write).
        for t in [text.as_str(), &text[..cut % (text.len() + 1)]] {
            std::fs::write(&path, t).unwrap();
            if let Ok(idx) = Index::read(&path) {
                prop_assert_eq!(idx.shards.iter().map(|s| s.tokens as u128).sum::<u128>(), idx.total_tokens as u128);
            }
        }
    }

    #[test]
    fn layouts_are_checked_and_their_offsets_stay_inside(d in dims(), offset in prop_oneof![0usize..10, any::<usize>()]) {
        let (shape, strides): (Vec<usize>, Vec<usize>) = d.into_iter().unzip();
        if let Ok(l) = Layout::new(shape.clone(), strides.clone(), offset) {
            let end = l.max_offset("fuzz").unwrap();
            let n = shape.iter().try_fold(1usize, |a, &s| a.checked_mul(s));
            prop_assert_eq!(Some(l.numel()), n, "numel of a constructed layout cannot overflow");
            if l.numel() <= 4096 {
                let offs: Vec<usize> = l.offsets().collect();
                prop_assert_eq!(offs.len(), l.numel());
                prop_assert!(offs.iter().all(|&o| o >= offset && o < end));
            }
            for dim in 0..l.rank() {
                let _ = l.narrow(dim, offset % 3, 1);
                let _ = l.transpose(dim, l.rank() - 1);
            }
        }
    }

    #[test]
    fn views_of_a_tensor_stay_inside_its_storage(d in dims(), offset in 0usize..64) {
        let t = Tensor::rand(&[8, 8], DType::F32, Device::Cpu, 1, -1.0, 1.0).unwrap();
        let (shape, strides): (Vec<usize>, Vec<usize>) = d.into_iter().unzip();
        if let Ok(v) = t.as_strided(&shape, &strides, offset) {
            // A zero stride can repeat the storage's elements astronomically often: read only
            // views small enough to materialise.
            prop_assume!(v.numel() <= 4096);
            let v = v.to_f64_vec().unwrap();
            prop_assert!(v.iter().all(|x| x.abs() <= 1.0));
        }
    }

    #[test]
    fn flag_parsers_never_panic(s in ".{0,24}", raw in prop::collection::vec(any::<u8>(), 0..24)) {
        let _ = Device::parse(&s);
        let _ = DType::parse(&s);
        let _ = Arch::parse_target(&s);
        let lossy = String::from_utf8_lossy(&raw);
        let _ = Device::parse(&lossy);
        let _ = Arch::parse_target(&lossy);
        for ok in ["cpu", "cuda", "cuda:0"] {
            prop_assert!(Device::parse(ok).is_ok());
        }
    }
}

// What the properties above found, pinned.

#[test]
fn a_zero_stride_layout_with_an_overflowing_count_is_refused() {
    let e = Layout::new(vec![1 << 40, 1 << 40], vec![0, 0], 0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("more than 2^64 elements"), "{e}");
}

#[test]
fn an_empty_narrow_at_the_end_of_a_huge_stride_is_a_view() {
    let l = Layout::new(vec![3], vec![usize::MAX / 2], 0).unwrap();
    let n = l.narrow(0, 3, 0).unwrap();
    assert_eq!(n.numel(), 0);
}

#[test]
fn an_index_whose_shard_counts_overflow_is_refused() {
    let shard = |t: u64| {
        format!(
            r#"{{"file":"s.ftok","format":"ferrite","dtype":"u16","tokens":{t},"bytes":0,"payload_offset":4096,"crc32":0,"chunk_crc32":[]}}"#
        )
    };
    let text = format!(
        r#"{{"format":"ferrite-token-index","version":1,"tokenizer":"gpt2","vocab_size":50257,"eot_token":null,"chunk_bytes":1048576,"total_tokens":1,"shards":[{},{}]}}"#,
        shard(u64::MAX),
        shard(2)
    );
    let dir = std::env::temp_dir().join(format!("ferrite-index-overflow-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("index.json");
    std::fs::write(&p, text).unwrap();
    let e = Index::read(&p).unwrap_err().to_string();
    assert!(e.contains("more than 2^64"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn walking_a_view_whose_next_step_would_pass_usize_max_stays_inside() {
    // Rows usize::MAX − 2 apart: the walk used to add the stride once more before wrapping.
    let s = usize::MAX - 2;
    let l = Layout::new(vec![2, 2], vec![1, s], 0).unwrap();
    let offs: Vec<usize> = l.offsets().collect();
    assert_eq!(offs, vec![0, s, 1, s + 1]);
}
