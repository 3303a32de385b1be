//! The categorical draw: one uniform `u ∈ [0, 1)` becomes a token by the
//! inverse CDF over the kept tokens in id order.
//!
//! The walk is defined over fixed blocks of [`BLOCK`] ids so it stays cheap
//! over a dense V: block sums (f64, eight lanes by `id % 8`, lanes combined
//! in a fixed order) give the total and locate the block holding
//! `u × total`; only that block is walked token by token. If rounding
//! leaves the walk inside the block short of the target, the block's last
//! token with mass is taken (and the last such token overall if the target
//! lies past every block).
//!
//! Zero weights change no sum, so [`draw_sparse`] over the kept tokens and
//! [`draw_dense`] over all of V follow the *same* arithmetic and pick the
//! same token for the same `u`. That is what lets a speculative
//! distribution be drawn from with exactly the outcome `sample` has.

use super::math::multiversion;

/// Ids per block of the walk.
const BLOCK: usize = 64;
const LANES: usize = 8;

#[inline(always)]
fn lanes_total(a: &[f64; LANES]) -> f64 {
    ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]))
}

multiversion! {
    /// Per-block sums of `probs` into `blocks`; returns their total.
    fn block_sums(probs: &[f32], blocks: &mut Vec<f64>) -> f64 {
        blocks.clear();
        let mut total = 0.0f64;
        for block in probs.chunks(BLOCK) {
            let mut acc = [0.0f64; LANES];
            let chunks = block.chunks_exact(LANES);
            let tail = chunks.remainder();
            for c in chunks {
                for l in 0..LANES {
                    acc[l] += f64::from(c[l]);
                }
            }
            for (l, &p) in tail.iter().enumerate() {
                acc[l] += f64::from(p);
            }
            let s = lanes_total(&acc);
            blocks.push(s);
            total += s;
        }
        total
    }
}

/// Draws from dense weights over V (non-negative, not necessarily
/// normalised). `blocks` is scratch. `None` when nothing has mass.
pub(crate) fn draw_dense(u: f64, probs: &[f32], blocks: &mut Vec<f64>) -> Option<usize> {
    let total = block_sums(probs, blocks);
    if total <= 0.0 || total.is_nan() {
        return None;
    }
    let target = u * total;
    let mut cum = 0.0f64;
    for (b, &s) in blocks.iter().enumerate() {
        if s > 0.0 && cum + s > target {
            let start = b * BLOCK;
            let end = (start + BLOCK).min(probs.len());
            let inner = probs[start..end]
                .iter()
                .enumerate()
                .map(|(j, &p)| (start + j, p));
            return walk(cum, target, inner);
        }
        cum += s;
    }
    probs.iter().rposition(|&p| p > 0.0)
}

/// Draws from the kept tokens `(id, weight)`, ids strictly ascending.
/// `blocks` is scratch. `None` when nothing has mass.
pub(crate) fn draw_sparse(
    u: f64,
    kept: &[(u32, f32)],
    blocks: &mut Vec<(usize, usize, f64)>,
) -> Option<usize> {
    // (block index, first entry of `kept` in it, block sum)
    blocks.clear();
    let mut total = 0.0f64;
    let mut i = 0;
    while i < kept.len() {
        let b = kept[i].0 as usize / BLOCK;
        let first = i;
        let mut acc = [0.0f64; LANES];
        while i < kept.len() && kept[i].0 as usize / BLOCK == b {
            acc[kept[i].0 as usize % LANES] += f64::from(kept[i].1);
            i += 1;
        }
        let s = lanes_total(&acc);
        blocks.push((b, first, s));
        total += s;
    }
    if total <= 0.0 || total.is_nan() {
        return None;
    }
    let target = u * total;
    let mut cum = 0.0f64;
    for &(b, first, s) in blocks.iter() {
        if s > 0.0 && cum + s > target {
            let inner = kept[first..]
                .iter()
                .take_while(|(id, _)| *id as usize / BLOCK == b)
                .map(|&(id, p)| (id as usize, p));
            return walk(cum, target, inner);
        }
        cum += s;
    }
    kept.iter()
        .rev()
        .find(|(_, p)| *p > 0.0)
        .map(|&(id, _)| id as usize)
}

/// Token-by-token walk inside the block holding the target.
fn walk(mut cum: f64, target: f64, inner: impl Iterator<Item = (usize, f32)>) -> Option<usize> {
    let mut last = None;
    for (i, p) in inner {
        if p > 0.0 {
            cum += f64::from(p);
            last = Some(i);
            if cum > target {
                return Some(i);
            }
        }
    }
    last
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn dense(p: &[f32], u: f64) -> Option<usize> {
        draw_dense(u, p, &mut Vec::new())
    }

    #[test]
    fn walks_in_order_and_skips_zeros() {
        let p = [0.0f32, 0.25, 0.0, 0.5, 0.25];
        assert_eq!(dense(&p, 0.0), Some(1));
        assert_eq!(dense(&p, 0.2499), Some(1));
        assert_eq!(dense(&p, 0.25), Some(3));
        assert_eq!(dense(&p, 0.9999), Some(4));
        assert_eq!(dense(&[0.0, 0.0], 0.5), None);
        // Unnormalised weights give the same choices.
        let q: Vec<f32> = p.iter().map(|x| x * 8.0).collect();
        assert_eq!(dense(&q, 0.3), Some(3));
    }

    #[test]
    fn crosses_blocks() {
        let mut p = vec![0.0f32; 300];
        p[10] = 1.0;
        p[130] = 1.0;
        p[299] = 2.0;
        assert_eq!(dense(&p, 0.2), Some(10));
        assert_eq!(dense(&p, 0.3), Some(130));
        assert_eq!(dense(&p, 0.6), Some(299));
    }

    #[test]
    fn sparse_and_dense_walks_agree_exactly() {
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        let (mut bd, mut bs) = (Vec::new(), Vec::new());
        for _ in 0..300 {
            let v = rng.random_range(1..700);
            let mut p = vec![0.0f32; v];
            let mut kept = Vec::new();
            for (i, x) in p.iter_mut().enumerate() {
                if rng.random::<f32>() < 0.2 {
                    *x = rng.random::<f32>() * 1e-3;
                    kept.push((i as u32, *x));
                }
            }
            for _ in 0..20 {
                let u = rng.random::<f64>();
                assert_eq!(
                    draw_dense(u, &p, &mut bd),
                    draw_sparse(u, &kept, &mut bs),
                    "v {v} u {u}"
                );
            }
        }
    }
}
