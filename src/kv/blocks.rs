//! The block pool: which KV blocks are free, which are owned (and by how
//! many sequences), and which hold a cached prefix.
//!
//! Plain data, no tensors: the scheduler owns one [`BlockPool`] and hands
//! the engine each sequence's block table; the engine's [`super::KvCache`]
//! only stores K/V where the tables say.
//!
//! # States of a block
//! - **free**: reference count 0, no hash; in `free` (lowest id first, so
//!   the engine's storage stays as small as the pool's high-water mark);
//! - **owned**: reference count ≥ 1 (several sequences share a cached
//!   prefix block); hashed or not;
//! - **cached**: reference count 0 with a hash; its K/V are kept for a
//!   later prefix hit and it sits in the LRU (`lru`, by release tick) until
//!   its memory is needed.
//!
//! Invariants (checked by [`BlockPool::check`] in tests):
//! `free ∪ lru ∪ {refs > 0}` is every block exactly once; a block has a hash
//! iff the hash index points at it; `available() = free + cached`.
//!
//! # Prefix hashes
//! A full block's hash chains its parent's hash, its token ids and the pool's
//! identity (the model: anything that changes K/V): equal hashes mean equal
//! K/V for the whole prefix. The index keeps each entry's parent hash and
//! tokens and compares them on lookup, so a 64-bit collision cannot alias
//! two different blocks' K/V.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::{Hash, Hasher};

/// Index of one block of the KV pool.
pub type BlockId = u32;

/// Chained hash of a full block (see the module doc).
pub type BlockHash = u64;

/// Tokens per block unless configured otherwise.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// Blocks needed to hold `tokens` positions.
pub fn blocks_for(tokens: usize, block_size: usize) -> usize {
    tokens.div_ceil(block_size)
}

#[derive(Debug, Clone)]
struct Entry {
    block: BlockId,
    parent: Option<BlockHash>,
    tokens: Box<[u32]>,
}

/// Counters of the prefix cache, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixCacheCounters {
    /// Prefix lookups (one per admission or resumption).
    pub queries: u64,
    /// Tokens looked up (the lookable part of each prompt).
    pub query_tokens: u64,
    /// Tokens found cached.
    pub hit_tokens: u64,
    /// Cached blocks whose memory was taken back for a new block.
    pub evictions: u64,
}

/// The allocator and prefix cache of a paged KV pool.
#[derive(Debug, Clone)]
pub struct BlockPool {
    block_size: usize,
    /// Salt of every hash: the model's identity.
    identity: u64,
    caching: bool,
    refs: Vec<u32>,
    /// The hash each cached / registered block is indexed under.
    hash_of: Vec<Option<BlockHash>>,
    free: BTreeSet<BlockId>,
    /// Release tick → cached block with reference count 0 (oldest first).
    lru: BTreeMap<u64, BlockId>,
    /// Tick of each block in `lru`.
    lru_tick: Vec<u64>,
    index: HashMap<BlockHash, Entry>,
    tick: u64,
    counters: PrefixCacheCounters,
}

impl BlockPool {
    /// `num_blocks` blocks of `block_size` tokens; `caching` turns the
    /// prefix cache on; `identity` salts the hashes (e.g. a hash of the
    /// model's name).
    pub fn new(num_blocks: usize, block_size: usize, caching: bool, identity: u64) -> Self {
        assert!(block_size > 0, "block size 0: this is a bug");
        Self {
            block_size,
            identity,
            caching,
            refs: vec![0; num_blocks],
            hash_of: vec![None; num_blocks],
            free: (0..num_blocks as BlockId).collect(),
            lru: BTreeMap::new(),
            lru_tick: vec![0; num_blocks],
            index: HashMap::new(),
            tick: 0,
            counters: PrefixCacheCounters::default(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.refs.len()
    }

    pub fn caching(&self) -> bool {
        self.caching
    }

    /// Blocks that can be handed out now: free plus cached (evictable).
    pub fn available(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    /// Blocks owned by at least one sequence.
    pub fn used(&self) -> usize {
        self.num_blocks() - self.available()
    }

    /// Cached blocks nobody owns (kept for prefix hits, evictable).
    pub fn cached(&self) -> usize {
        self.lru.len()
    }

    pub fn counters(&self) -> PrefixCacheCounters {
        self.counters
    }

    /// Reference count of a block (tests and checks).
    pub fn refs(&self, block: BlockId) -> u32 {
        self.refs[block as usize]
    }

    /// The hash of a full block of `tokens` after a block hashed `parent`.
    pub fn hash_block(&self, parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.identity.hash(&mut h);
        parent.hash(&mut h);
        tokens.hash(&mut h);
        h.finish()
    }

    /// One block, owned once; the lowest free id, else the least recently
    /// released cached block (its hash is forgotten). `None` when every
    /// block is owned.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let block = match self.free.pop_first() {
            Some(b) => b,
            None => {
                let (_, b) = self.lru.pop_first()?;
                if let Some(hash) = self.hash_of[b as usize].take() {
                    self.index.remove(&hash);
                }
                self.counters.evictions += 1;
                b
            }
        };
        debug_assert_eq!(self.refs[block as usize], 0);
        self.refs[block as usize] = 1;
        Some(block)
    }

    /// One more owner of an owned or cached block.
    pub fn retain(&mut self, block: BlockId) {
        let i = block as usize;
        if self.refs[i] == 0 {
            let removed = self.lru.remove(&self.lru_tick[i]);
            debug_assert_eq!(removed, Some(block), "retained a free block: this is a bug");
        }
        self.refs[i] += 1;
    }

    /// One owner fewer. A block nobody owns becomes cached when it is
    /// hashed, free otherwise.
    pub fn release(&mut self, block: BlockId) {
        let i = block as usize;
        assert!(
            self.refs[i] > 0,
            "released a block nobody owns: this is a bug"
        );
        self.refs[i] -= 1;
        if self.refs[i] > 0 {
            return;
        }
        if self.hash_of[i].is_some() {
            self.tick += 1;
            self.lru_tick[i] = self.tick;
            self.lru.insert(self.tick, block);
        } else {
            self.free.insert(block);
        }
    }

    /// Indexes an owned full block under `hash` (unless the hash is already
    /// indexed: the first block computed keeps the entry, this one stays
    /// private). No-op with caching off.
    pub fn register(
        &mut self,
        block: BlockId,
        hash: BlockHash,
        parent: Option<BlockHash>,
        tokens: &[u32],
    ) {
        if !self.caching || self.index.contains_key(&hash) {
            return;
        }
        debug_assert!(self.refs[block as usize] > 0);
        if self.hash_of[block as usize].is_some() {
            return;
        }
        self.hash_of[block as usize] = Some(hash);
        self.index.insert(
            hash,
            Entry {
                block,
                parent,
                tokens: tokens.into(),
            },
        );
    }

    /// The cached block holding `tokens` after `parent`, if any.
    fn find(&self, parent: Option<BlockHash>, tokens: &[u32]) -> Option<(BlockId, BlockHash)> {
        let hash = self.hash_block(parent, tokens);
        let e = self.index.get(&hash)?;
        (e.parent == parent && *e.tokens == *tokens).then_some((e.block, hash))
    }

    /// Looks up the longest cached prefix of `tokens` in full blocks, at
    /// most `max_blocks` of them, and retains every block found. Counts the
    /// query (`tokens.len()` lookable tokens). Returns the blocks and the
    /// last one's hash.
    pub fn claim_prefix(
        &mut self,
        tokens: &[u32],
        max_blocks: usize,
    ) -> (Vec<BlockId>, Option<BlockHash>) {
        let mut found = Vec::new();
        let mut parent = None;
        if !self.caching {
            return (found, parent);
        }
        self.counters.queries += 1;
        self.counters.query_tokens += tokens.len() as u64;
        for chunk in tokens.chunks_exact(self.block_size).take(max_blocks) {
            let Some((block, hash)) = self.find(parent, chunk) else {
                break;
            };
            found.push(block);
            parent = Some(hash);
        }
        for &b in &found {
            self.retain(b);
        }
        self.counters.hit_tokens += (found.len() * self.block_size) as u64;
        (found, parent)
    }

    /// How many of `tokens`' leading full blocks (at most `max_blocks`) are
    /// cached, without claiming them (admission estimates). Also returns how
    /// many of those are cached with nobody owning them (claiming them takes
    /// them out of [`available`](Self::available)).
    pub fn peek_prefix(&self, tokens: &[u32], max_blocks: usize) -> (usize, usize) {
        if !self.caching {
            return (0, 0);
        }
        let (mut hits, mut idle) = (0, 0);
        let mut parent = None;
        for chunk in tokens.chunks_exact(self.block_size).take(max_blocks) {
            let Some((block, hash)) = self.find(parent, chunk) else {
                break;
            };
            hits += 1;
            idle += usize::from(self.refs[block as usize] == 0);
            parent = Some(hash);
        }
        (hits, idle)
    }

    /// Checks the invariants of the module doc; panics on a violation.
    pub fn check(&self) {
        let n = self.num_blocks();
        let mut seen = vec![0u8; n];
        for &b in &self.free {
            seen[b as usize] += 1;
            assert_eq!(self.refs[b as usize], 0, "free block {b} is owned");
            assert!(self.hash_of[b as usize].is_none(), "free block {b} hashed");
        }
        for (&tick, &b) in &self.lru {
            seen[b as usize] += 1;
            assert_eq!(self.lru_tick[b as usize], tick);
            assert_eq!(self.refs[b as usize], 0, "cached block {b} is owned");
            assert!(
                self.hash_of[b as usize].is_some(),
                "cached block {b} unhashed"
            );
        }
        for (b, &r) in self.refs.iter().enumerate() {
            if r > 0 {
                seen[b] += 1;
            }
            assert_eq!(seen[b], 1, "block {b} in {} states", seen[b]);
            if let Some(h) = self.hash_of[b] {
                assert_eq!(self.index.get(&h).map(|e| e.block), Some(b as BlockId));
            }
        }
        for (h, e) in &self.index {
            assert_eq!(self.hash_of[e.block as usize], Some(*h));
        }
    }
}

/// One sequence's blocks: its block table and how much of it is indexed in
/// the prefix cache.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SeqBlocks {
    /// Logical block i of the sequence lives in pool block `table[i]`.
    pub table: Vec<BlockId>,
    /// Leading blocks whose hash is known (hit or registered).
    hashed: usize,
    /// Hash of block `hashed - 1`.
    last_hash: Option<BlockHash>,
}

impl SeqBlocks {
    /// A table starting with a claimed cached prefix (see
    /// [`BlockPool::claim_prefix`]).
    pub fn with_prefix(blocks: Vec<BlockId>, last_hash: Option<BlockHash>) -> Self {
        Self {
            hashed: blocks.len(),
            table: blocks,
            last_hash,
        }
    }

    /// A table starting with another sequence's first `blocks`, which hold
    /// the K/V of `tokens`' leading full blocks (the `n` choices of one
    /// request share their prompt this way, with or without the prefix
    /// cache). Each block is retained once more for the new table. With
    /// caching on, the blocks' chained hashes are recomputed, so this
    /// table's later blocks chain from the right parent.
    pub fn share_prefix(pool: &mut BlockPool, blocks: &[BlockId], tokens: &[u32]) -> Self {
        let bs = pool.block_size();
        assert!(
            tokens.len() >= blocks.len() * bs,
            "shared blocks past the tokens: this is a bug"
        );
        let mut last_hash = None;
        if pool.caching() {
            for chunk in tokens.chunks_exact(bs).take(blocks.len()) {
                last_hash = Some(pool.hash_block(last_hash, chunk));
            }
        }
        for &b in blocks {
            pool.retain(b);
        }
        Self {
            table: blocks.to_vec(),
            hashed: blocks.len(),
            last_hash,
        }
    }

    /// Positions the table can hold.
    pub fn room(&self, block_size: usize) -> usize {
        self.table.len() * block_size
    }

    /// Blocks [`grow_to`](Self::grow_to)`(tokens)` would take.
    pub fn blocks_short(&self, tokens: usize, block_size: usize) -> usize {
        blocks_for(tokens, block_size).saturating_sub(self.table.len())
    }

    /// Takes blocks until the table holds `tokens` positions; all or
    /// nothing. Returns false (taking nothing) when the pool is short.
    pub fn grow_to(&mut self, pool: &mut BlockPool, tokens: usize) -> bool {
        let short = self.blocks_short(tokens, pool.block_size());
        if short > pool.available() {
            return false;
        }
        for _ in 0..short {
            let b = pool.allocate().expect("available() counted it");
            self.table.push(b);
        }
        true
    }

    /// Returns the blocks past those needed for `tokens` positions (drafts
    /// rejected, room planned but not used). Hashed blocks are never past.
    pub fn trim_to(&mut self, pool: &mut BlockPool, tokens: usize) {
        let keep = blocks_for(tokens, pool.block_size()).max(self.hashed);
        while self.table.len() > keep {
            let b = self.table.pop().expect("len > keep");
            pool.release(b);
        }
    }

    /// Indexes every full block of the first `computed` positions not yet
    /// hashed; `token_at(p)` is the token at position `p` (known for every
    /// computed position).
    pub fn register_full(
        &mut self,
        pool: &mut BlockPool,
        computed: usize,
        token_at: impl Fn(usize) -> u32,
    ) {
        if !pool.caching() {
            return;
        }
        let bs = pool.block_size();
        let full = (computed / bs).min(self.table.len());
        let mut tokens = Vec::with_capacity(bs);
        while self.hashed < full {
            let i = self.hashed;
            tokens.clear();
            tokens.extend((i * bs..(i + 1) * bs).map(&token_at));
            let hash = pool.hash_block(self.last_hash, &tokens);
            pool.register(self.table[i], hash, self.last_hash, &tokens);
            self.last_hash = Some(hash);
            self.hashed += 1;
        }
    }

    /// Returns every block (tail first, so the tail is evicted first).
    pub fn free(&mut self, pool: &mut BlockPool) {
        while let Some(b) = self.table.pop() {
            pool.release(b);
        }
        self.hashed = 0;
        self.last_hash = None;
    }
}

#[cfg(test)]
#[path = "blocks_tests.rs"]
mod tests;
