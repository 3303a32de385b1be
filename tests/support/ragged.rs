//! One ragged step, batched and sequence by sequence: what the model tests
//! compare across KV storages and devices.

use tandem::kv::KvCache;
use tandem::model::{Batch, Model, OutputRows};

/// Deterministic prompt ids below `vocab`.
pub fn prompt(seed: u32, len: usize, vocab: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (seed * 31 + i * 17 + 3) % vocab)
        .collect()
}

/// The logits rows of `model.forward` + `unembed` on the host.
pub fn step(model: &Model, kv: &mut KvCache, batch: &Batch) -> Vec<Vec<f32>> {
    let logits = model.unembed(&model.forward(batch, kv).unwrap()).unwrap();
    logits
        .to_device(&candle_core::Device::Cpu)
        .unwrap()
        .to_vec2()
        .unwrap()
}

/// For each `(history, len, out)` of `shapes` (sequence `i` in slot
/// `10 + i`, its ids from [`prompt`]): feeds `history` tokens into both
/// `shared` and a fresh cache from `own_kv`, runs the next `len` tokens
/// alone in its own cache, and adds them to one batch. Then runs that batch
/// over `shared`. Returns the batch, its logits rows and the solo rows in
/// the same order.
pub fn ragged_vs_solo(
    model: &Model,
    shapes: &[(usize, usize, OutputRows)],
    shared: &mut KvCache,
    own_kv: impl Fn() -> KvCache,
) -> (Batch, Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let mut batch = Batch::default();
    let mut solo = Vec::new();
    for (i, &(history, len, out)) in shapes.iter().enumerate() {
        let slot = i as u32 + 10;
        let toks = prompt(i as u32, history + len, model.config().vocab_size as u32);
        let mut own = own_kv();
        let room = (history + len).max(64);
        own.allocate(slot, room).unwrap();
        shared.allocate(slot, room).unwrap();
        if history > 0 {
            for kv in [&mut own, &mut *shared] {
                let mut b = Batch::default();
                b.push(slot, 0, &toks[..history], OutputRows::None);
                assert_eq!(model.forward(&b, kv).unwrap().dim(0).unwrap(), 0);
            }
        }
        let mut b = Batch::default();
        b.push(slot, history, &toks[history..], out);
        solo.extend(step(model, &mut own, &b));
        batch.push(slot, history, &toks[history..], out);
    }
    let got = step(model, shared, &batch);
    (batch, got, solo)
}

/// After slot 3 of `kv` took `toks` and then committed `accepted` of
/// `drafts` (speculation), its next step must equal that of a fresh
/// `reference` cache fed only `toks` and the accepted drafts.
pub fn assert_commit_equals_feeding_accepted(
    model: &Model,
    kv: &mut KvCache,
    mut reference: KvCache,
    toks: &[u32],
    drafts: &[u32],
    accepted: usize,
) {
    reference.allocate(3, 64).unwrap();
    let mut all = toks.to_vec();
    all.extend_from_slice(&drafts[..accepted]);
    let mut b = Batch::default();
    b.push(3, 0, &all, OutputRows::Last);
    model.forward(&b, &mut reference).unwrap();

    let next = |kv: &mut KvCache| {
        let mut b = Batch::default();
        b.push(3, toks.len() + accepted, &[42], OutputRows::Last);
        step(model, kv, &b).remove(0)
    };
    let (got, want) = (next(kv), next(&mut reference));
    let d = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert_eq!(got.len(), want.len());
    assert!(d <= 1e-4, "accepted {accepted}: diff {d}");
}
