//! Tests that measure timing under a load they make themselves, in a test
//! binary of their own: cargo runs test binaries one after another, so
//! nothing else of the suite runs beside them (in `tests/all`, the Python
//! and JavaScript tests, the multi-process clusters and the chaos runs
//! would compete with the load these tests make and measure, at normal
//! priority, and the verdict would depend on which of them ran alongside).

mod load_fence;
