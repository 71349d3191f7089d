//! placeholder
use crate::core::harness::{CheckConfig, CheckRecord};
pub fn run(_c: &CheckConfig, _o: &mut Vec<CheckRecord>) -> crate::core::error::Result<()> {
    Ok(())
}
