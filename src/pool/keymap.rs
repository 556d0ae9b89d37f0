//! The hasher of the pool's address- and id-keyed maps. Every malloc and free looks one up, so
//! the hash is kept cheap; it lives apart because it is plumbing, not allocator policy.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Hasher for maps keyed by addresses and ids, which every malloc and free looks up. The keys
/// are not chosen by an adversary, so SipHash's protection is not needed; a folded multiply
/// mixes the zero low bits of aligned addresses into every bit of the hash.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.write_u64(u64::from(byte));
        }
    }

    fn write_u64(&mut self, n: u64) {
        const K: u64 = 0x9e37_79b9_7f4a_7c15;
        let product = u128::from(self.0 ^ n) * u128::from(K);
        self.0 = (product as u64) ^ ((product >> 64) as u64);
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// A map keyed by addresses or ids, hashed with [`KeyHasher`].
pub(super) type KeyMap<K, V> = HashMap<K, V, BuildHasherDefault<KeyHasher>>;
