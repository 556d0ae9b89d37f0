//! The cap on the physical memory a pool creates, given as a fraction of the device or in bytes.
//!
//! The cap is kept in whole bytes. A fraction becomes the nearest byte of `total * fraction`
//! (PyTorch truncates), so a fraction computed from a byte budget (`budget / total`) gives that
//! budget back exactly: both roundings of f64 together are off by at most `2^-52` of the budget,
//! under half a byte for any budget below 2 PiB. Memory is created in whole granules, so the part
//! of a cap the allocator can fill is the cap rounded down to the granularity.

use crate::error::{Error, Result};

/// How the cap was last set: what [`MemoryCap::fraction`] reports back.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Given {
    Fraction(f64),
    Bytes,
}

/// A pool's cap on physical memory, against the device's total.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemoryCap {
    total: usize,
    bytes: usize,
    given: Given,
}

impl MemoryCap {
    /// The cap of a pool made with `fraction` and, when given, a byte `limit` (the lower wins).
    pub fn new(total: usize, fraction: f64, limit: Option<usize>) -> Result<Self> {
        let mut cap = MemoryCap {
            total,
            bytes: total,
            given: Given::Fraction(1.0),
        };
        cap.set_fraction(fraction)?;
        if let Some(bytes) = limit {
            if bytes < cap.bytes {
                cap.set_bytes(bytes)?;
            }
        }
        Ok(cap)
    }

    /// Caps at `fraction` of the device, in [0, 1] (0, as in PyTorch, lets the pool create
    /// nothing more: every request that needs new memory fails).
    pub fn set_fraction(&mut self, fraction: f64) -> Result<()> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(Error::invalid_argument(format!(
                "memory fraction {fraction} must be in [0, 1]"
            )));
        }
        self.bytes = bytes_of_fraction(self.total, fraction);
        self.given = Given::Fraction(fraction);
        Ok(())
    }

    /// Caps at `bytes`; more than the device has is the device's total.
    pub fn set_bytes(&mut self, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Err(Error::invalid_argument("memory limit of 0 bytes"));
        }
        self.bytes = bytes.min(self.total);
        self.given = Given::Bytes;
        Ok(())
    }

    /// The cap in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The fraction last set, or the cap's share of the device when it was set in bytes.
    pub fn fraction(&self) -> f64 {
        match self.given {
            Given::Fraction(f) => f,
            Given::Bytes if self.total == 0 => 1.0,
            Given::Bytes => self.bytes as f64 / self.total as f64,
        }
    }

    /// Whether `more` bytes on top of `reserved` stay within the cap.
    pub fn fits(&self, reserved: usize, more: usize) -> bool {
        reserved.saturating_add(more) <= self.bytes
    }
}

/// The nearest byte of `total * fraction`, at most `total`.
pub fn bytes_of_fraction(total: usize, fraction: f64) -> usize {
    // `as` saturates: NaN and negatives become 0 (callers validate the fraction first).
    (((total as f64) * fraction).round() as usize).min(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;
    const GIB: usize = 1 << 30;

    /// Device totals, round and odd; the first is the total of the reported bug.
    const TOTALS: [usize; 10] = [
        85_000_000_003,
        85_017_493_504,  // an H100 80GB HBM3, as cuMemGetInfo reported it
        150_754_820_096, // an H200: 143771 MiB
        80 * GIB,
        64 * GIB,
        24 * GIB + 123_456_789,
        16 * GIB - 1,
        1 << 47,
        (1 << 50) + 12_345,
        4 * MIB + 511,
    ];

    /// A deterministic spread of budgets in (0, total]: granule multiples, odd bytes, edges.
    fn budgets(total: usize) -> Vec<usize> {
        let mut out = vec![1, 2, 511, 2 * MIB, total - 1, total];
        let mut x: u64 = 0x2545_f491_4f6c_dd1d ^ total as u64;
        for i in 0..2000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let b = (x % total as u64) as usize + 1;
            out.push(b);
            out.push((b / (2 * MIB)).max(1) * 2 * MIB % total + i % 2);
        }
        out.retain(|&b| b > 0 && b <= total);
        out
    }

    #[test]
    fn a_fraction_from_a_budget_gives_the_budget_back() {
        for total in TOTALS {
            for budget in budgets(total) {
                let fraction = budget as f64 / total as f64;
                let cap = MemoryCap::new(total, fraction, None).expect("valid fraction");
                assert_eq!(cap.bytes(), budget, "total {total}, budget {budget}");
                assert_eq!(cap.fraction(), fraction);
            }
        }
    }

    #[test]
    fn the_bug_that_was_reported_holds_its_budget() {
        // 1 GiB of an 85000000003-byte device used to come back as 1 GiB - 1 byte.
        let total = 85_000_000_003;
        let cap = MemoryCap::new(total, GIB as f64 / total as f64, None).expect("valid");
        assert!(cap.fits(0, GIB));
        assert!(!cap.fits(GIB, 1));
    }

    #[test]
    fn byte_limits_and_fractions() {
        let total = 80 * GIB;
        let mut cap = MemoryCap::new(total, 0.5, Some(8 * GIB)).expect("valid");
        assert_eq!(cap.bytes(), 8 * GIB, "the lower of the two wins");
        assert_eq!(cap.fraction(), 0.1);
        cap.set_fraction(0.25).expect("valid");
        assert_eq!(cap.bytes(), 20 * GIB, "the latest setting wins");
        assert_eq!(cap.fraction(), 0.25);
        cap.set_bytes(usize::MAX).expect("valid");
        assert_eq!(cap.bytes(), total, "clamped to the device");
        assert!(cap.set_bytes(0).is_err());
        for bad in [-0.1, 1.0001, f64::NAN, f64::INFINITY] {
            assert!(cap.set_fraction(bad).is_err(), "{bad}");
        }
        assert_eq!(cap.bytes(), total, "a refused setting changes nothing");
        cap.set_fraction(0.0)
            .expect("0 is PyTorch's way to allow nothing more");
        assert_eq!(cap.bytes(), 0);
        assert!(!cap.fits(0, 1));
        assert_eq!(bytes_of_fraction(total, 1.0), total);
    }
}
