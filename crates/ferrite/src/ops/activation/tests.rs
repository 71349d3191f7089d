//! activation tests: the check harness on every device present, semantics, and bad input.

use super::*;

#[test]
fn every_variant_passes_check() {
    let recs = crate::core::harness::check::assert_quick_check_passes(check::run, 2 * 3 * 10);
    assert!(recs.iter().any(|r| r.shape.starts_with("dropout mask")));
}
