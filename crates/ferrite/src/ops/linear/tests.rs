//! linear tests (CPU, in CI): the check harness, CPU determinism, QKV views, and bad inputs.

use super::*;

#[test]
fn every_variant_passes_check() {
    crate::core::harness::check::assert_quick_check_passes(check::run, 2 * 3 * check::cases(true).len());
}
