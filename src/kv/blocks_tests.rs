use proptest::prelude::*;

use super::*;

const BS: usize = 4;

fn tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i * 7 + salt).collect()
}

#[test]
fn same_prompt_twice_hits_every_full_block_but_the_last_token() {
    let mut pool = BlockPool::new(16, BS, true, 1);
    let prompt = tokens(10, 0); // 2 full blocks + 2 tokens
    let mut a = SeqBlocks::default();
    assert!(a.grow_to(&mut pool, prompt.len()));
    a.register_full(&mut pool, prompt.len(), |p| prompt[p]);
    a.free(&mut pool);
    assert_eq!((pool.cached(), pool.available()), (2, 16));
    let (hit, last) = pool.claim_prefix(&prompt[..prompt.len() - 1], usize::MAX);
    assert_eq!(hit.len(), 2);
    assert!(last.is_some());
    assert_eq!(pool.counters().hit_tokens, 8);
    assert_eq!(pool.cached(), 0, "claimed blocks are owned again");
    pool.check();
}

#[test]
fn a_partial_block_share_reuses_only_full_blocks() {
    let mut pool = BlockPool::new(16, BS, true, 1);
    let a_prompt = tokens(12, 0);
    let mut a = SeqBlocks::default();
    assert!(a.grow_to(&mut pool, 12));
    a.register_full(&mut pool, 12, |p| a_prompt[p]);
    // Shares 6 tokens: one full block, then differs inside the second.
    let mut b_prompt = a_prompt[..6].to_vec();
    b_prompt.extend([99, 98, 97, 96]);
    let (hit, _) = pool.claim_prefix(&b_prompt, usize::MAX);
    assert_eq!(hit, vec![a.table[0]]);
    assert_eq!(pool.refs(a.table[0]), 2);
    // A different model identity shares nothing.
    let other = BlockPool::new(16, BS, true, 2);
    assert_ne!(
        other.hash_block(None, &a_prompt[..4]),
        pool.hash_block(None, &a_prompt[..4])
    );
    pool.check();
}

#[test]
fn eviction_takes_cached_blocks_lru_and_never_an_owned_one() {
    let mut pool = BlockPool::new(4, BS, true, 1);
    let p = tokens(16, 0);
    let mut a = SeqBlocks::default();
    assert!(a.grow_to(&mut pool, 16));
    a.register_full(&mut pool, 16, |i| p[i]);
    let owned = a.table[0];
    // Keep block 0 owned by a second sequence; free the first one.
    let (hit, _) = pool.claim_prefix(&p[..4], 1);
    assert_eq!(hit, vec![owned]);
    let mut b = SeqBlocks::with_prefix(hit, None);
    a.free(&mut pool);
    assert_eq!(pool.cached(), 3);
    // Memory pressure: three new blocks evict the three cached ones, and a
    // fourth is refused rather than taken from the owner.
    let mut c = SeqBlocks::default();
    assert!(c.grow_to(&mut pool, 12));
    assert!(!c.table.contains(&owned));
    assert!(!c.grow_to(&mut pool, 16));
    assert_eq!(pool.counters().evictions, 3);
    assert_eq!(pool.refs(owned), 1);
    pool.check();
    b.free(&mut pool);
    c.free(&mut pool);
    assert_eq!(pool.available(), 4);
    pool.check();
}

#[test]
fn trim_returns_draft_blocks_but_keeps_hashed_ones() {
    let mut pool = BlockPool::new(8, BS, true, 1);
    let p = tokens(8, 3);
    let mut s = SeqBlocks::default();
    assert!(s.grow_to(&mut pool, 8 + 6)); // 8 computed + 6 draft positions
    assert_eq!(s.table.len(), 4);
    s.register_full(&mut pool, 8, |i| p[i]);
    s.trim_to(&mut pool, 9); // one draft accepted
    assert_eq!(s.table.len(), 3);
    s.trim_to(&mut pool, 0);
    assert_eq!(s.table.len(), 2, "hashed blocks stay");
    pool.check();
}

#[test]
fn caching_off_shares_nothing() {
    let mut pool = BlockPool::new(8, BS, false, 1);
    let p = tokens(8, 0);
    let mut s = SeqBlocks::default();
    assert!(s.grow_to(&mut pool, 8));
    s.register_full(&mut pool, 8, |i| p[i]);
    s.free(&mut pool);
    assert_eq!(pool.cached(), 0);
    assert!(pool.claim_prefix(&p, 2).0.is_empty());
    assert_eq!(pool.counters().queries, 0);
}

/// One random operation on the pool.
#[derive(Debug, Clone)]
enum Op {
    /// A sequence arrives with a prompt from one of a few families (so
    /// prefixes are shared), claims its cached prefix and takes blocks for
    /// the rest.
    Arrive { family: u32, len: usize },
    /// Sequence `i` (mod live) decodes one token with `drafts` drafts, of
    /// which `accepted` are kept.
    Step {
        i: usize,
        drafts: usize,
        accepted: usize,
    },
    /// Sequence `i` ends (finish or cancel).
    End { i: usize },
    /// Sequence `i` is preempted (all its blocks back) and resumed at once
    /// from the cache.
    Preempt { i: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u32..3, 1usize..40).prop_map(|(family, len)| Op::Arrive { family, len }),
        (0usize..64, 0usize..6, 0usize..6).prop_map(|(i, drafts, a)| Op::Step {
            i,
            drafts,
            accepted: a.min(drafts)
        }),
        (0usize..64).prop_map(|i| Op::End { i }),
        (0usize..64).prop_map(|i| Op::Preempt { i }),
    ]
}

struct Seq {
    tokens: Vec<u32>,
    /// Positions whose K/V are computed.
    computed: usize,
    blocks: SeqBlocks,
}

/// Checks the pool against a model: each block's reference count equals the
/// number of live tables holding it, and no table holds a block twice.
fn check_model(pool: &BlockPool, seqs: &[Seq]) {
    pool.check();
    let mut owners = vec![0u32; pool.num_blocks()];
    for s in seqs {
        let mut mine = std::collections::HashSet::new();
        for &b in &s.blocks.table {
            assert!(mine.insert(b), "block {b} twice in one table");
            owners[b as usize] += 1;
        }
        assert!(s.blocks.room(pool.block_size()) >= s.computed);
    }
    for (b, &n) in owners.iter().enumerate() {
        assert_eq!(pool.refs(b as BlockId), n, "block {b}");
    }
    assert_eq!(pool.used(), owners.iter().filter(|&&n| n > 0).count());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn random_traffic_never_leaks_or_double_owns(ops in proptest::collection::vec(op(), 1..120)) {
        let mut pool = BlockPool::new(24, BS, true, 7);
        let mut seqs: Vec<Seq> = Vec::new();
        for op in ops {
            match op {
                Op::Arrive { family, len } => {
                    let mut t: Vec<u32> = tokens(len, 1000 * family);
                    t.truncate(len);
                    let lookable = &t[..len - 1];
                    let (hit, last) = pool.claim_prefix(lookable, usize::MAX);
                    let mut blocks = SeqBlocks::with_prefix(hit, last);
                    let cached = blocks.table.len() * BS;
                    if blocks.grow_to(&mut pool, len) {
                        blocks.register_full(&mut pool, len, |p| t[p]);
                        seqs.push(Seq { tokens: t, computed: len, blocks });
                    } else {
                        // Admission refused: give the prefix back.
                        prop_assert!(cached < len);
                        blocks.free(&mut pool);
                    }
                }
                Op::Step { i, drafts, accepted } if !seqs.is_empty() => {
                    let n = seqs.len();
                    let s = &mut seqs[i % n];
                    if s.blocks.grow_to(&mut pool, s.computed + 1 + drafts) {
                        let next = s.tokens.len() as u32 * 13;
                        for k in 0..=accepted {
                            s.tokens.push(next + k as u32);
                        }
                        s.computed += 1 + accepted;
                        let t = &s.tokens;
                        s.blocks.trim_to(&mut pool, s.computed);
                        s.blocks.register_full(&mut pool, s.computed, |p| t[p]);
                    }
                }
                Op::End { i } if !seqs.is_empty() => {
                    let mut s = seqs.swap_remove(i % seqs.len());
                    s.blocks.free(&mut pool);
                }
                Op::Preempt { i } if !seqs.is_empty() => {
                    let n = seqs.len();
                    let s = &mut seqs[i % n];
                    s.blocks.free(&mut pool);
                    let (hit, last) = pool.claim_prefix(&s.tokens[..s.computed], usize::MAX);
                    s.blocks = SeqBlocks::with_prefix(hit, last);
                    if !s.blocks.grow_to(&mut pool, s.computed) {
                        let mut s = seqs.swap_remove(i % n);
                        s.blocks.free(&mut pool);
                    }
                }
                _ => {}
            }
            check_model(&pool, &seqs);
        }
        for mut s in seqs.drain(..) {
            s.blocks.free(&mut pool);
        }
        check_model(&pool, &seqs);
        prop_assert_eq!(pool.available(), pool.num_blocks());
        prop_assert_eq!(pool.used(), 0);
    }
}

#[test]
fn a_shared_prefix_is_owned_twice_and_chains_like_the_original() {
    for caching in [true, false] {
        let mut pool = BlockPool::new(16, BS, caching, 1);
        let prompt = tokens(10, 0);
        let mut a = SeqBlocks::default();
        assert!(a.grow_to(&mut pool, prompt.len()));
        a.register_full(&mut pool, prompt.len(), |p| prompt[p]);
        let mut b = SeqBlocks::share_prefix(&mut pool, &a.table[..2], &prompt);
        assert_eq!(b.table, a.table[..2]);
        assert_eq!(pool.refs(a.table[0]), 2, "caching {caching}");
        // The sibling's own next block chains from the shared prefix, as the
        // original's third block would.
        let mut own = prompt[..8].to_vec();
        own.extend([50, 51, 52, 53]);
        assert!(b.grow_to(&mut pool, 12));
        b.register_full(&mut pool, 12, |p| own[p]);
        assert_eq!(b.last_hash.is_some(), caching);
        if caching {
            let (hit, _) = pool.claim_prefix(&own, usize::MAX);
            assert_eq!(
                hit, b.table,
                "the sibling's block is found after the shared two"
            );
            for &blk in &hit {
                pool.release(blk);
            }
        }
        a.free(&mut pool);
        b.free(&mut pool);
        assert_eq!(pool.used(), 0, "caching {caching}");
        pool.check();
    }
}
