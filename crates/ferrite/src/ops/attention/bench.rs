//! placeholder
use crate::core::harness::{BenchConfig, BenchRecord, Ceilings};
pub fn run(
    _c: &BenchConfig,
    _ce: &Ceilings,
    _p: &mut dyn FnMut(&str),
    _o: &mut Vec<BenchRecord>,
) -> crate::core::error::Result<()> {
    Ok(())
}
