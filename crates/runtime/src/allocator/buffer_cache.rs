//! Freed buffers kept for reuse, keyed by size, with least-recently-freed eviction (the shape
//! of MLX's `BufferCache`).

use std::collections::BTreeMap;

use super::Block as CachedBlock;

#[derive(Debug, Default)]
pub(crate) struct BufferCache {
    /// capacity → stamps of cached blocks of that capacity.
    by_size: BTreeMap<usize, Vec<u64>>,
    /// stamp → block; stamps grow, so the first entry is the least recently freed.
    lru: BTreeMap<u64, CachedBlock>,
    bytes: usize,
    next_stamp: u64,
}

impl BufferCache {
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn insert(&mut self, block: CachedBlock) {
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        self.bytes += block.capacity;
        self.by_size.entry(block.capacity).or_default().push(stamp);
        self.lru.insert(stamp, block);
    }

    /// The most recently freed block that holds `size` bytes without wasting more than its
    /// size again: a block twice as large is better returned to the system than half-used.
    pub fn take(&mut self, size: usize) -> Option<CachedBlock> {
        let max = size.saturating_mul(2);
        let (&capacity, stamps) = self.by_size.range_mut(size..=max).next()?;
        let stamp = stamps.pop()?;
        if stamps.is_empty() {
            self.by_size.remove(&capacity);
        }
        let block = self.lru.remove(&stamp)?;
        self.bytes -= block.capacity;
        Some(block)
    }

    /// Removes and returns the least recently freed block.
    pub fn pop_oldest(&mut self) -> Option<CachedBlock> {
        let (stamp, block) = self.lru.pop_first()?;
        if let Some(stamps) = self.by_size.get_mut(&block.capacity) {
            stamps.retain(|&s| s != stamp);
            if stamps.is_empty() {
                self.by_size.remove(&block.capacity);
            }
        }
        self.bytes -= block.capacity;
        Some(block)
    }
}
