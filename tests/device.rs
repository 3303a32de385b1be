//! The GPU code path: candle ops, pooled KV and batched attention.
//!
//! With `--features cuda` and a CUDA device present these tests run on
//! GPU 0 (`TANDEM_REQUIRE_GPU=1` makes its absence a failure); otherwise they run the same code path on the CPU (the candle
//! reference ops instead of the lean kernels, with pooled KV), so CI checks
//! the path a GPU takes even without one. Every comparison is against the
//! per-sequence attention over per-slot KV, which `tests/model.rs` checks
//! against the stories260k reference.

mod support;

use candle_core::{DType, Device, Tensor};
use support::engine_driver::{run_staggered, run_tokens, Req};
use support::ragged::{assert_commit_equals_feeding_accepted, prompt, ragged_vs_solo, step};
use support::reference::{stories260k, Stories};
use tandem::engine::{
    DraftSchedule, EarlyExitDraft, Engine, EngineConfig, GeneratedToken, SpecConfig, SpecOptions,
};
use tandem::kv::KvCache;
use tandem::model::{Batch, LoadOptions, Model, ModelConfig, OutputRows, Weights};
use tandem::sampler::{Sampler, SamplerError, SamplingOptions};

/// GPU 0 when this build and machine have one, else the CPU.
fn test_device() -> Device {
    match Device::new_cuda(0) {
        Ok(device) => device,
        Err(e) => {
            if std::env::var_os("TANDEM_REQUIRE_GPU").is_some() {
                panic!("TANDEM_REQUIRE_GPU is set but CUDA device 0 cannot be opened: {e}");
            }
            eprintln!("NOTE: no CUDA device ({e}); running the GPU code path on the CPU");
            Device::Cpu
        }
    }
}

fn options(device: &Device, dtype: DType) -> LoadOptions {
    LoadOptions {
        dtype,
        device: device.clone(),
        lean_cpu: false,
        ..LoadOptions::default()
    }
}

/// A small random GQA model (2 KV heads shared by 4 query heads).
fn small_model(device: &Device, sliding_window: Option<usize>) -> Model {
    small_model_for(device, sliding_window, 256)
}

/// [`small_model`] for contexts up to `max_positions`.
fn small_model_for(device: &Device, sliding_window: Option<usize>, max_positions: usize) -> Model {
    small_model_in(device, sliding_window, max_positions, DType::F32)
}

/// A model of `json`'s config with random weights (`seed`, the head's
/// spread `lm_head_std`) on `device` in `dtype`.
fn random_model(
    device: &Device,
    dtype: DType,
    json: &serde_json::Value,
    seed: u64,
    lm_head_std: f32,
) -> Model {
    let cfg = ModelConfig::from_json(&json.to_string()).unwrap();
    let w = Weights::random(&cfg, seed, lm_head_std).unwrap();
    Model::load(cfg, &w, &options(device, dtype)).unwrap()
}

/// [`small_model_for`] computing in `dtype`.
fn small_model_in(
    device: &Device,
    sliding_window: Option<usize>,
    max_positions: usize,
    dtype: DType,
) -> Model {
    let json = serde_json::json!({
        "architectures": [if sliding_window.is_some() { "MistralForCausalLM" } else { "LlamaForCausalLM" }],
        "vocab_size": 97, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": max_positions, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": false, "sliding_window": sliding_window,
    });
    random_model(device, dtype, &json, 7, 0.5)
}

/// The dtypes a bit-for-bit test runs in: f32 and bf16 on a GPU, f32 on
/// the CPU path.
fn exact_dtypes(device: &Device) -> &'static [DType] {
    if device.is_cuda() {
        &[DType::F32, DType::BF16]
    } else {
        &[DType::F32]
    }
}

/// `got` equals `want` bit for bit where `exact`, else within `tolerance`.
fn assert_rows_agree(exact: bool, got: &[f32], want: &[f32], tolerance: f32, what: &str) {
    if exact {
        assert!(got == want, "{what}");
    } else {
        let d = max_abs_diff(got, want);
        assert!(d <= tolerance, "{what} differs by {d}");
    }
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Ragged batches (decodes, prefills, draft verification shapes) through
/// batched attention over pooled KV equal each sequence run alone through
/// per-sequence attention over per-slot KV.
#[test]
fn pooled_batched_attention_equals_per_sequence() {
    let device = test_device();
    // (history already in cache, tokens this step, output rows)
    let ragged = [
        // 7 sequences of at most 6 tokens: all padded together.
        (0, 5, OutputRows::Last),
        (3, 1, OutputRows::Last),
        (10, 4, OutputRows::All),
        (1, 1, OutputRows::All),
        (0, 6, OutputRows::All),
        (6, 2, OutputRows::Last),
        (20, 3, OutputRows::Last),
    ];
    let mixed = [
        // A long prefill chunk before decodes: the decodes are padded
        // together, the chunk is attended alone, rows put back in order.
        (0, 30, OutputRows::All),
        (3, 1, OutputRows::Last),
        (10, 1, OutputRows::All),
        (6, 2, OutputRows::Last),
        (20, 1, OutputRows::Last),
    ];
    for (window, shapes) in [
        (None, &ragged[..]),
        (Some(5), &ragged[..]),
        (None, &mixed[..]),
        (Some(5), &mixed[..]),
    ] {
        let model = small_model(&device, window);
        let mut pooled = KvCache::pooled(model.kv_layout(), device.clone(), 4096);
        let own = || KvCache::per_slot(model.kv_layout(), device.clone(), 4096);
        let (batch, got, solo) = ragged_vs_solo(&model, shapes, &mut pooled, own);
        assert_eq!(got.len(), solo.len());
        for (g, s) in got.iter().zip(&solo) {
            let d = max_abs_diff(g, s);
            assert!(d <= 1e-4, "window {window:?}: pooled batch differs by {d}");
        }
        // A uniform decode step (no padding) agrees too.
        let mut decode = Batch::default();
        let mut want = Vec::new();
        for (i, s) in batch.seqs.iter().enumerate() {
            let at = s.offset + s.len;
            decode.push(s.slot, at, &[(i as u32 * 5 + 1) % 97], OutputRows::Last);
        }
        let got = step(&model, &mut pooled, &decode);
        // Reference: replay every sequence alone, per slot.
        for (i, &(history, len, _)) in shapes.iter().enumerate() {
            let slot = i as u32 + 10;
            let mut toks = prompt(i as u32, history + len, 97);
            toks.push((i as u32 * 5 + 1) % 97);
            let mut own = KvCache::per_slot(model.kv_layout(), device.clone(), 4096);
            own.allocate(slot, 64).unwrap();
            let mut b = Batch::default();
            b.push(slot, 0, &toks, OutputRows::Last);
            want.extend(step(&model, &mut own, &b));
        }
        for (g, w) in got.iter().zip(&want) {
            let d = max_abs_diff(g, w);
            assert!(d <= 1e-4, "window {window:?}: decode differs by {d}");
        }
    }
}

/// A two-layer Llama of random weights and a `vocab`-token vocabulary
/// with the given widths: hidden, MLP, query heads, KV heads, head size; a
/// Mistral where it has a sliding window.
fn two_layer_model_in(
    device: &Device,
    dtype: DType,
    (seed, vocab): (u64, usize),
    (hidden, mlp, heads, kv_heads, head_dim): (usize, usize, usize, usize, usize),
    sliding_window: Option<usize>,
) -> Model {
    let json = serde_json::json!({
        "architectures": [if sliding_window.is_some() { "MistralForCausalLM" } else { "LlamaForCausalLM" }],
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": mlp,
        "num_hidden_layers": 2, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": false, "sliding_window": sliding_window,
    });
    random_model(device, dtype, &json, seed, 0.05)
}

/// SmolLM2-135M's widths: hidden 576, MLP 1 536, 9 heads of 64 over 3 KV
/// heads.
const SMOLLM2_WIDTHS: (usize, usize, usize, usize, usize) = (576, 1536, 9, 3, 64);

/// Two layers of SmolLM2-135M's widths: the kernels' real row widths at a
/// test's cost.
fn smollm2_wide_model_in(device: &Device, dtype: DType) -> Model {
    two_layer_model_in(device, dtype, (11, 97), SMOLLM2_WIDTHS, None)
}

/// Two layers of a 1B-class Llama's attention layout (32 query heads over
/// 8 KV heads, four a KV head) at heads of 32 and narrow projections, so
/// every projection takes the GEMV at 8 rows in f32 and bf16 under either
/// row rule (`TANDEM_GEMV=fast` too).
fn gqa4_model_in(device: &Device, dtype: DType) -> Model {
    two_layer_model_in(device, dtype, (13, 97), (576, 512, 32, 8, 32), None)
}

/// Many narrow heads on narrow projections (every projection a GEMV at 8
/// rows in f32 and bf16 under either row rule): 512 query heads of 8 over
/// 128 KV heads, so that a decode batch of a few rows launches as many
/// (query, head group) blocks as a large batch of a 1B-class model; with
/// `sliding_window` where given.
fn many_grouped_heads_model_in(
    device: &Device,
    dtype: DType,
    sliding_window: Option<usize>,
) -> Model {
    let widths = (128, 256, 512, 128, 8);
    two_layer_model_in(device, dtype, (17, 97), widths, sliding_window)
}

/// Decode batches of up to 9 rows take Tandem's GEMV kernel on a GPU,
/// whose sums do not depend on the row count, beside per-row attention and
/// norms (folded into the projections for every row count or for none):
/// there a sequence's logits are the same bits in any decode batch the
/// GEMV takes, in any order, at a toy model's widths, at SmolLM2's and at
/// a 1B-class attention layout. Attention launches four ways, the same bits each: a
/// solo decode's stages its rows in shared memory; batches run a block a
/// query head; and in the four-heads-a-KV-head model the 8-row batch, whose
/// 190-key history splits in three, launches 8 x 8 x 3 = 192 grouped
/// blocks (a KV head's four query heads in one block), at least one per
/// multiprocessor (H100 and H200: 132). In the many-grouped-heads model
/// (512 heads of 8 over 128 KV heads) a batch of 5 or 8 rows with that
/// history launches 5 x 128 = 640 or more grouped blocks: past the serial
/// threshold (2 or 4 blocks an SM), each block runs its query's three
/// splits itself, staged in shared memory, and merges them there; with a
/// sliding window of 150 that history's decode sees keys 41..=190, still
/// three splits, from a first key inside a block. The CPU path agrees
/// within rounding.
#[test]
fn small_decode_batches_are_batch_invariant() {
    let device = test_device();
    let dtypes = exact_dtypes(&device);
    let histories = [3usize, 17, 40, 1, 190, 9, 25, 33, 12];
    // Every projection takes the GEMV at up to 9 rows, SmolLM2's gate/up
    // (7 MiB in f32) included.
    let models = |dtype| {
        [
            ("toy", small_model_in(&device, None, 256, dtype)),
            ("SmolLM2 widths", smollm2_wide_model_in(&device, dtype)),
            ("GQA-4 layout", gqa4_model_in(&device, dtype)),
            (
                "many grouped heads",
                many_grouped_heads_model_in(&device, dtype, None),
            ),
            (
                "many grouped heads, window 150",
                many_grouped_heads_model_in(&device, dtype, Some(150)),
            ),
        ]
    };
    for (&dtype, (name, model)) in dtypes.iter().flat_map(|d| models(*d).map(|m| (d, m))) {
        // Every history prefilled alone, so the caches hold the same bits.
        let prefilled = || {
            let mut kv = KvCache::pooled(model.kv_layout(), device.clone(), 4096);
            for (i, &h) in histories.iter().enumerate() {
                kv.allocate(i as u32, 256).unwrap();
                let mut b = Batch::default();
                b.push(i as u32, 0, &prompt(i as u32, h, 97), OutputRows::Last);
                step(&model, &mut kv, &b);
            }
            kv
        };
        let decode = |seqs: &[usize]| {
            let mut b = Batch::default();
            for &i in seqs {
                let token = (i as u32 * 7 + 2) % 97;
                b.push(i as u32, histories[i], &[token], OutputRows::Last);
            }
            step(&model, &mut prefilled(), &b)
        };
        let solo: Vec<Vec<f32>> = (0..histories.len())
            .map(|i| decode(&[i]).remove(0))
            .collect();
        for size in [2, 5, 8, 9] {
            let seqs: Vec<usize> = (0..size).rev().collect();
            let tolerance = if dtype == DType::F32 { 1e-4 } else { 5e-2 };
            for (row, &i) in decode(&seqs).iter().zip(&seqs) {
                let what = format!("{name} {dtype:?}: sequence {i} in a batch of {size}");
                assert_rows_agree(device.is_cuda(), row, &solo[i], tolerance, &what);
            }
        }
    }
}

/// SmolLM2-135M's widths with an 8 192-token vocabulary: an unembedding
/// of 9.4 MB in bf16, over the 4 MiB past which `TANDEM_GEMV=fast` hands 3
/// rows and more to cuBLAS (as SmolLM2's own 56 MB one).
fn smollm2_wide_vocab_model_in(device: &Device, dtype: DType) -> Model {
    two_layer_model_in(device, dtype, (19, 8192), SMOLLM2_WIDTHS, None)
}

/// A lone stream's verifying pass (a token and the default 8 drafts: 9
/// rows of one sequence) computes each row as the one-row passes feeding
/// the same tokens one at a time do. On a GPU these are the same bits:
/// the GEMV kernel takes 9 rows against any weights (cuBLAS's tiles, which
/// `TANDEM_GEMV=fast` gives 3 rows and more of weights over 4 MiB, sum in
/// other orders, and then a greedy near-tie flips: issue 18, BENCHMARKS.md)
/// and attention sums a query row's keys in the same order in both. On the
/// CPU path (candle's reference ops) within rounding.
#[test]
fn a_lone_verifying_pass_equals_its_one_row_passes() {
    let device = test_device();
    let dtypes = exact_dtypes(&device);
    for &dtype in dtypes {
        let models = [
            ("toy", small_model_in(&device, None, 256, dtype)),
            (
                "SmolLM2 widths, 8 192-token vocabulary",
                smollm2_wide_vocab_model_in(&device, dtype),
            ),
        ];
        for (name, model) in models {
            let vocab = model.config().vocab_size as u32;
            let (history, fed) = (prompt(5, 40, vocab), prompt(6, 9, vocab));
            let prefilled = || {
                let mut kv = KvCache::pooled(model.kv_layout(), device.clone(), 4096);
                kv.allocate(0, 256).unwrap();
                let mut b = Batch::default();
                b.push(0, 0, &history, OutputRows::Last);
                step(&model, &mut kv, &b);
                kv
            };
            let mut b = Batch::default();
            b.push(0, history.len(), &fed, OutputRows::All);
            let verified = step(&model, &mut prefilled(), &b);
            let mut kv = prefilled();
            for (i, &token) in fed.iter().enumerate() {
                let mut b = Batch::default();
                b.push(0, history.len() + i, &[token], OutputRows::Last);
                let one = step(&model, &mut kv, &b).remove(0);
                let what = format!("{name} {dtype:?}: row {i} of the verifying pass");
                assert_rows_agree(device.is_cuda(), &verified[i], &one, 1e-4, &what);
            }
        }
    }
}

/// Passes past 9 rows: decode batches of 16 and 41 sequences, and a mixed
/// pass of 12 decodes, a 5-token verifying span and a 30-token prompt. A
/// decode row equals its sequence's one-row pass, the span's rows the span
/// alone and the prompt's last row the prompt alone, bit for bit wherever
/// the model promises it ([`Model::batch_invariant_rows`]: on a GPU with
/// `TANDEM_BATCH_INVARIANT=1`, Tandem's GEMV taking every projection in
/// chunks of up to 9 rows, any pass), and within rounding elsewhere (a
/// GPU's default hands passes over 9 rows to cuBLAS; the CPU path runs
/// candle's matmuls).
#[test]
fn large_and_mixed_passes_are_batch_invariant_where_the_model_promises() {
    let device = test_device();
    for &dtype in exact_dtypes(&device) {
        let models = [
            ("toy", small_model_in(&device, None, 256, dtype)),
            (
                "SmolLM2 widths, 8 192-token vocabulary",
                smollm2_wide_vocab_model_in(&device, dtype),
            ),
            ("GQA-4 layout", gqa4_model_in(&device, dtype)),
        ];
        for (name, model) in models {
            let bound = model.batch_invariant_rows();
            if device.is_cuda() && bound.is_some() {
                eprintln!(
                    "NOTE: {name}: passes over {bound:?} rows are compared within rounding \
                     (TANDEM_BATCH_INVARIANT=1 makes every pass exact)"
                );
            }
            let vocab = model.config().vocab_size as u32;
            let histories: Vec<usize> = (0..41).map(|i| 1 + (i * 37) % 150).collect();
            let (span, fresh) = (prompt(50, 5, vocab), prompt(51, 30, vocab));
            // Every history prefilled alone, once: a pass writes its rows'
            // keys and values at the same positions every time and reads
            // no other pass's.
            let mut kv = KvCache::pooled(model.kv_layout(), device.clone(), 16384);
            for (i, &h) in histories.iter().enumerate() {
                kv.allocate(i as u32, 256).unwrap();
                let mut b = Batch::default();
                b.push(i as u32, 0, &prompt(i as u32, h, vocab), OutputRows::Last);
                step(&model, &mut kv, &b);
            }
            kv.allocate(41, 256).unwrap();
            let kv = std::cell::RefCell::new(kv);
            let push_decode = |b: &mut Batch, i: usize| {
                let token = (i as u32 * 7 + 2) % vocab;
                b.push(i as u32, histories[i], &[token], OutputRows::Last);
            };
            let alone = |fill: &dyn Fn(&mut Batch)| {
                let mut b = Batch::default();
                fill(&mut b);
                let kv = &mut kv.borrow_mut();
                let out = step(&model, kv, &b);
                for s in &b.seqs {
                    kv.set_len(s.slot, s.offset).unwrap();
                }
                out
            };
            let solo: Vec<Vec<f32>> = (0..histories.len())
                .map(|i| alone(&|b| push_decode(b, i)).remove(0))
                .collect();
            let span_alone = alone(&|b| b.push(12, histories[12], &span, OutputRows::All));
            let fresh_alone = alone(&|b| b.push(41, 0, &fresh, OutputRows::Last));
            let tolerance = if dtype == DType::F32 { 2e-3 } else { 1e-1 };
            let check = |rows: usize, got: &[f32], want: &[f32], what: String| {
                let exact = device.is_cuda() && bound.is_none_or(|b| rows <= b);
                let what = format!("{name} {dtype:?}: {what}");
                assert_rows_agree(exact, got, want, tolerance, &what);
            };
            for size in [16, 41] {
                let seqs: Vec<usize> = (0..size).rev().collect();
                let got = alone(&|b| seqs.iter().for_each(|&i| push_decode(b, i)));
                for (row, &i) in got.iter().zip(&seqs) {
                    check(
                        size,
                        row,
                        &solo[i],
                        format!("sequence {i} in a batch of {size}"),
                    );
                }
            }
            // 12 decodes, the span (sequence 12's next 5 tokens), the prompt.
            let mixed = alone(&|b| {
                (0..12).for_each(|i| push_decode(b, i));
                b.push(12, histories[12], &span, OutputRows::All);
                b.push(41, 0, &fresh, OutputRows::Last);
            });
            let rows = 12 + span.len() + fresh.len();
            for (i, want) in solo.iter().take(12).enumerate() {
                check(rows, &mixed[i], want, format!("decode {i} beside a prompt"));
            }
            for (j, want) in span_alone.iter().enumerate() {
                check(
                    rows,
                    &mixed[12 + j],
                    want,
                    format!("span row {j} beside a prompt"),
                );
            }
            check(
                rows,
                &mixed[17],
                &fresh_alone[0],
                "the prompt's last row".into(),
            );
        }
    }
}

/// Sixteen requests at once, greedy and seeded sampled, with early-exit
/// drafts of 1 to 4 tokens: their verifying passes hold 16 to 80 rows, and
/// every request emits exactly its speculation-off tokens, where the
/// model's passes are batch-invariant at any size (the lean CPU path; a
/// GPU with `TANDEM_BATCH_INVARIANT=1`). A GPU's default (cuBLAS past 9
/// rows) skips it, saying so.
#[test]
fn speculating_batches_of_16_equal_plain_where_passes_are_batch_invariant() {
    let Some(Stories { dir, prompts, .. }) = stories260k() else {
        return;
    };
    let device = test_device();
    for &dtype in exact_dtypes(&device) {
        let opts = LoadOptions {
            lean_cpu: !device.is_cuda(),
            ..options(&device, dtype)
        };
        let model = || Model::from_dir(&dir, &opts).unwrap();
        let probe = model();
        if let Some(bound) = probe.batch_invariant_rows().filter(|&b| b < 80) {
            eprintln!(
                "NOTE: skipped on this device: passes over {bound} rows are not batch-invariant \
                 (TANDEM_BATCH_INVARIANT=1 makes them so)"
            );
            return;
        }
        let layers = probe.config().num_layers / 2;
        let sampling = |i: usize| match i % 3 {
            2 => SamplingOptions {
                temperature: 0.8,
                seed: Some(i as u64),
                ..Default::default()
            },
            _ => SamplingOptions::greedy(),
        };
        let plain_reqs: Vec<Req> = (0..16)
            .map(|i| Req::new(prompts[i % prompts.len()].clone(), sampling(i), 32))
            .collect();
        let spec_reqs: Vec<Req> = plain_reqs
            .iter()
            .enumerate()
            .map(|(i, r)| Req {
                spec: Some(SpecOptions::constant(1 + i % 4)),
                ..r.clone()
            })
            .collect();
        let want = run_tokens(&mut engine_for(model()), &plain_reqs, 512);
        let mut spec = engine_for(model())
            .with_draft(Box::new(EarlyExitDraft { layers }), SpecConfig::default());
        let got = run_tokens(&mut spec, &spec_reqs, 512);
        for i in 0..want.len() {
            assert_eq!(ids(&got[i]), ids(&want[i]), "{dtype:?}: request {i}");
        }
    }
}

/// Long histories split their keys across blocks (split-K: one split up to
/// 64 keys, 2–16 splits of up to 64 keys below 1 024, 16 longer splits
/// above, with and without a sliding window): a ragged batch of decodes,
/// verification rows and a prefill chunk over such histories equals each
/// sequence alone, and agrees with the candle reference ops on the CPU.
#[test]
fn split_key_attention_over_long_histories_equals_per_sequence() {
    let device = test_device();
    let shapes = [
        (40, 1, OutputRows::Last),
        (64, 1, OutputRows::Last),
        (200, 3, OutputRows::All),
        (700, 1, OutputRows::Last),
        (1023, 2, OutputRows::All),
        (1500, 1, OutputRows::Last),
        (90, 40, OutputRows::All),
    ];
    let run = |device: &Device, window| {
        let model = small_model_for(device, window, 2048);
        let mut pooled = KvCache::pooled(model.kv_layout(), device.clone(), 8192);
        let own = || KvCache::per_slot(model.kv_layout(), device.clone(), 2048);
        ragged_vs_solo(&model, &shapes, &mut pooled, own)
    };
    for window in [None, Some(300)] {
        let (_, got, solo) = run(&device, window);
        let (_, reference, _) = run(&Device::Cpu, window);
        assert_eq!(got.len(), solo.len());
        for ((g, s), r) in got.iter().zip(&solo).zip(&reference) {
            let d = max_abs_diff(g, s);
            assert!(
                d <= 1e-4,
                "window {window:?}: batched differs from solo by {d}"
            );
            let d = max_abs_diff(g, r);
            assert!(
                d <= 1e-3,
                "window {window:?}: differs from the CPU reference by {d}"
            );
        }
    }
}

/// Speculation on pooled KV: committing j of k drafts leaves the cache as
/// if only the j tokens had been fed.
#[test]
fn pooled_speculation_commit_equals_feeding_only_accepted() {
    let device = test_device();
    let model = small_model(&device, None);
    let toks = prompt(2, 10, 97);
    let drafts = [11u32, 12, 13, 14];
    for accepted in 0..=drafts.len() {
        let mut kv = KvCache::pooled(model.kv_layout(), device.clone(), 128);
        // A neighbour on both sides keeps the slot's range inside the pool.
        kv.allocate(1, 16).unwrap();
        kv.allocate(3, 64).unwrap();
        kv.allocate(4, 16).unwrap();
        let mut b = Batch::default();
        b.push(3, 0, &toks, OutputRows::Last);
        b.push(4, 0, &toks[..3], OutputRows::Last);
        model.forward(&b, &mut kv).unwrap();
        kv.begin(3).unwrap();
        let mut b = Batch::default();
        b.push(3, 10, &drafts, OutputRows::All);
        b.push(4, 3, &[5], OutputRows::Last);
        model.forward(&b, &mut kv).unwrap();
        kv.commit(3, accepted).unwrap();

        let reference = KvCache::per_slot(model.kv_layout(), device.clone(), 128);
        assert_commit_equals_feeding_accepted(&model, &mut kv, reference, &toks, &drafts, accepted);
    }
}

/// Freed blocks are reused (lowest first), so a new slot's table is
/// scattered between live ones; every slot still reads its own keys.
#[test]
fn paged_kv_reuses_freed_blocks_and_stays_correct() {
    let device = test_device();
    let model = small_model(&device, None);
    let mut kv = KvCache::own(model.kv_layout(), device.clone(), 1000, 4);
    for (slot, reserve) in [(1, 8), (2, 20), (3, 40), (4, 35)] {
        kv.allocate(slot, reserve).unwrap();
    }
    let mut b = Batch::default();
    for slot in [1, 2, 3, 4] {
        b.push(slot, 0, &prompt(slot, 7, 97), OutputRows::None);
    }
    model.forward(&b, &mut kv).unwrap();
    assert_eq!(kv.table(1).unwrap(), &[0, 1]);
    assert!(kv.free(1) && kv.free(3));
    kv.allocate(5, 30).unwrap();
    let mut b = Batch::default();
    b.push(5, 0, &prompt(5, 15, 97), OutputRows::None);
    model.forward(&b, &mut kv).unwrap();
    assert_eq!(
        kv.table(5).unwrap(),
        &[0, 1, 4, 5],
        "freed blocks, lowest first"
    );
    let mut b = Batch::default();
    for (slot, at) in [(2, 7), (4, 7), (5, 15)] {
        b.push(slot, at, &[7], OutputRows::Last);
    }
    let got = step(&model, &mut kv, &b);
    for (i, (slot, len)) in [(2u32, 7), (4, 7), (5, 15)].into_iter().enumerate() {
        let mut own = KvCache::per_slot(model.kv_layout(), device.clone(), 64);
        own.allocate(slot, 20).unwrap();
        let mut toks = prompt(slot, len, 97);
        toks.push(7);
        let mut b = Batch::default();
        b.push(slot, 0, &toks, OutputRows::Last);
        let want = step(&model, &mut own, &b).remove(0);
        let d = max_abs_diff(&got[i], &want);
        assert!(d <= 1e-4, "slot {slot} over reused blocks: diff {d}");
    }
}

fn engine_for(model: Model) -> Engine {
    Engine::new(
        model,
        EngineConfig {
            kv_capacity_tokens: 4096,
            model_name: "test".into(),
            eos_ids: vec![],
            ..Default::default()
        },
    )
}

fn ids(tokens: &[GeneratedToken]) -> Vec<u32> {
    tokens.iter().map(|t| t.id).collect()
}

/// The stories260k reference ids in f32 on the test device, through the
/// engine (pooled KV on a GPU, device argmax), solo and batched.
#[test]
fn stories260k_reference_on_the_device() {
    let Some(Stories {
        dir,
        prompts,
        generated: want,
    }) = stories260k()
    else {
        return;
    };
    let device = test_device();
    let model = Model::from_dir(&dir, &options(&device, DType::F32)).unwrap();
    let mut engine = engine_for(model);
    let reqs: Vec<Req> = prompts
        .iter()
        .map(|p| Req::new(p.clone(), SamplingOptions::greedy(), 64))
        .collect();
    for (r, w) in reqs.iter().zip(&want) {
        let got = run_tokens(&mut engine, std::slice::from_ref(r), 512);
        assert_eq!(&ids(&got[0]), w, "solo");
    }
    for chunk in [3, 512] {
        let got: Vec<Vec<u32>> = run_tokens(&mut engine, &reqs, chunk)
            .iter()
            .map(|t| ids(t))
            .collect();
        assert_eq!(got, want, "batched, prefill chunk {chunk}");
    }
    assert_eq!(engine.kv_reserved_tokens(), 0);
}

/// Mixed sampling options in one batch equal each request alone on the
/// test device (the sampler's host and device paths side by side).
#[test]
fn mixed_options_batched_equal_solo_on_the_device() {
    let Some(Stories { dir, prompts, .. }) = stories260k() else {
        return;
    };
    let device = test_device();
    let model = Model::from_dir(&dir, &options(&device, DType::F32)).unwrap();
    let mut engine = engine_for(model);
    let sampling = [
        SamplingOptions::greedy(),
        SamplingOptions {
            temperature: 0.8,
            top_p: 0.9,
            seed: Some(7),
            ..Default::default()
        },
        SamplingOptions {
            logprobs: true,
            top_logprobs: 3,
            ..Default::default()
        },
        SamplingOptions {
            repeat_penalty: 1.3,
            presence_penalty: 0.5,
            ..Default::default()
        },
    ];
    // With and without a logprobs request (which adds the log-softmax and
    // top lists to the device sampler's work).
    for kinds in [&sampling[..], &[sampling[0], sampling[1], sampling[3]]] {
        let reqs: Vec<Req> = (0..8)
            .map(|i| {
                let p = prompts[i % prompts.len()].clone();
                Req::new(p, kinds[i % kinds.len()], 24)
            })
            .collect();
        let batched = run_tokens(&mut engine, &reqs, 512);
        for (i, r) in reqs.iter().enumerate() {
            let solo = run_tokens(&mut engine, std::slice::from_ref(r), 512);
            assert_eq!(ids(&batched[i]), ids(&solo[0]), "request {i}");
        }
    }
}

/// Speculative decoding on the device: greedy MTP with early-exit drafts
/// gives exactly the plain greedy tokens, for plain greedy sequences (which
/// draft and verify from ids alone, one launch each on a GPU) and penalised
/// ones (which go through the sampler's distributions) in one batch.
#[test]
fn greedy_mtp_equals_plain_greedy_on_the_device() {
    let Some(Stories { dir, prompts, .. }) = stories260k() else {
        return;
    };
    let device = test_device();
    let model = || Model::from_dir(&dir, &options(&device, DType::F32)).unwrap();
    let spec = SpecOptions {
        initial_draft: 3,
        max_draft: 4,
        schedule: DraftSchedule::Constant,
        enabled: true,
    };
    let sampling = [
        SamplingOptions::greedy(),
        SamplingOptions {
            repeat_penalty: 1.3,
            repeat_last_n: 8,
            ..Default::default()
        },
    ];
    let layers = model().config().num_layers / 2;
    let mtp =
        engine_for(model()).with_draft(Box::new(EarlyExitDraft { layers }), SpecConfig::default());
    assert_speculation_exact(engine_for(model()), mtp, &prompts, sampling, |_| spec);
}

/// Six requests over `prompts`, alternating `sampling`, 24 tokens each:
/// `spec` (request `i` asking for `spec_of(i)`) emits exactly the tokens
/// of `plain`.
fn assert_speculation_exact(
    mut plain: Engine,
    mut spec: Engine,
    prompts: &[Vec<u32>],
    sampling: [SamplingOptions; 2],
    spec_of: impl Fn(usize) -> SpecOptions,
) {
    let plain_reqs: Vec<Req> = (0..6)
        .map(|i| Req::new(prompts[i % prompts.len()].clone(), sampling[i % 2], 24))
        .collect();
    let spec_reqs: Vec<Req> = plain_reqs
        .iter()
        .enumerate()
        .map(|(i, r)| Req {
            spec: Some(spec_of(i)),
            ..r.clone()
        })
        .collect();
    let want = run_tokens(&mut plain, &plain_reqs, 512);
    let got = run_tokens(&mut spec, &spec_reqs, 512);
    for i in 0..want.len() {
        assert_eq!(ids(&got[i]), ids(&want[i]), "request {i}");
    }
}

/// On the device, an MTP head with a draft vocabulary (its widening to the
/// full vocabulary runs there) beside prompt lookup: greedy and seeded
/// sampled requests emit exactly their speculation-off tokens (the seeded
/// ones' keyed uniforms cross to the sampling kernel and to verification
/// alike).
#[test]
fn speculation_with_a_draft_vocab_head_and_lookup_is_exact_on_the_device() {
    use tandem::engine::{MtpDraft, PromptLookup};
    use tandem::model::mtp::{random_tensors, DRAFT_VOCAB_TENSOR};
    use tandem::model::MtpHead;
    let Some(Stories { dir, prompts, .. }) = stories260k() else {
        return;
    };
    let device = test_device();
    let model = || Model::from_dir(&dir, &options(&device, DType::F32)).unwrap();
    let sampling = [
        SamplingOptions::greedy(),
        SamplingOptions {
            temperature: 0.8,
            seed: Some(3),
            ..Default::default()
        },
    ];
    let target = model();
    let v = target.config().vocab_size as u32;
    let kept: Vec<u32> = (0..v).filter(|i| i % 2 == 0).collect();
    let mut tensors = random_tensors(target.config(), 3).unwrap();
    tensors.insert(
        DRAFT_VOCAB_TENSOR.into(),
        Tensor::new(kept.as_slice(), &Device::Cpu).unwrap(),
    );
    let head = MtpHead::from_tensors(&target, tensors, std::path::Path::new("<random>")).unwrap();
    let config = SpecConfig {
        prompt_lookup: Some(PromptLookup::default()),
        ..Default::default()
    };
    let spec = engine_for(target).with_draft(Box::new(MtpDraft { head }), config);
    assert_speculation_exact(engine_for(model()), spec, &prompts, sampling, |i| {
        SpecOptions::constant(1 + i % 4)
    });
}

/// CUDA graphs of decode passes: replays equal the eager passes token for
/// token, over decode batches that change size between steps (requests
/// join late and finish at different lengths), greedy, seeded sampled and
/// penalised rows together, with MTP drafts on (verification passes
/// replay as plain decode passes do), and again on the same engine, whose
/// block tables then differ (freed blocks reused in another order) and
/// whose pool may have grown. Without a GPU both engines run eagerly, and
/// the test checks the same path a GPU's eager pass takes.
#[test]
fn decode_graph_replays_equal_eager_passes() {
    let Some(Stories { dir, prompts, .. }) = stories260k() else {
        return;
    };
    let device = test_device();
    let model = |graphs: bool| {
        let m = Model::from_dir(&dir, &options(&device, DType::F32)).unwrap();
        m.set_cuda_graphs(graphs);
        m
    };
    let sampling = [
        SamplingOptions::greedy(),
        SamplingOptions {
            temperature: 0.8,
            top_p: 0.9,
            seed: Some(11),
            ..Default::default()
        },
        SamplingOptions {
            repeat_penalty: 1.3,
            repeat_last_n: 8,
            ..Default::default()
        },
    ];
    let reqs: Vec<Req> = (0..9)
        .map(|i| {
            let mut r = Req::new(
                prompts[i % prompts.len()].clone(),
                sampling[i % sampling.len()],
                12 + 5 * (i % 4),
            );
            // A third draft two tokens every step (those passes verify);
            // the rest never draft, so some passes are plain decodes.
            r.spec = Some(if i % 3 == 1 {
                SpecOptions::constant(2)
            } else {
                SpecOptions::off()
            });
            r
        })
        .collect();
    let joins: Vec<usize> = (0..reqs.len())
        .map(|i| [0, 0, 3, 7, 7, 12, 20, 21, 30][i])
        .collect();
    let layers = model(false).config().num_layers / 2;
    let engine = |graphs: bool| {
        engine_for(model(graphs))
            .with_draft(Box::new(EarlyExitDraft { layers }), SpecConfig::default())
    };
    let mut eager = engine(false);
    let mut graphed = engine(true);
    for round in 0..2 {
        let want = run_staggered(&mut eager, &reqs, &joins);
        let got = run_staggered(&mut graphed, &reqs, &joins);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "round {round}, request {i}");
        }
    }
    let stats = graphed.model().cuda_graph_stats();
    assert_eq!(eager.model().cuda_graph_stats(), Default::default());
    if device.is_cuda() && cfg!(feature = "cuda") {
        eprintln!("decode graphs: {stats:?}");
        assert!(stats.captures > 0 && stats.replays > 0, "{stats:?}");
        assert!(stats.verify_replays > 0, "{stats:?}");
        assert!(stats.verify_replays < stats.replays, "{stats:?}");
        assert!(stats.kernels > 0, "{stats:?}");
    } else {
        assert_eq!(stats, Default::default());
    }
}

/// A graph pass writes its rows' hidden states into the KV cache's hidden
/// buffer itself (the engine then skips its own write, which costs a
/// scatter and its upload every step): each at its sequence's position,
/// equal to the rows the pass returns, on the capturing pass and on the
/// replays, prompt chunks of graph shape included. A pass too long for a
/// graph, and every pass without a GPU, leaves them to the engine.
#[test]
fn a_graph_pass_writes_its_hidden_rows_where_the_engine_would() {
    let device = test_device();
    let model = small_model(&device, None);
    model.set_cuda_graphs(true);
    let graphs = device.is_cuda() && cfg!(feature = "cuda");
    let mut kv = KvCache::pooled(model.kv_layout(), device.clone(), 4096);
    kv.store_hidden(model.config().hidden_size, model.dtype());
    let host = |t: Tensor| -> Vec<Vec<f32>> { t.to_dtype(DType::F32).unwrap().to_vec2().unwrap() };
    let tokens = |i: usize, n: usize| -> Vec<u32> {
        (0..n as u32).map(|t| (t * 7 + i as u32) % 97).collect()
    };
    // Sequence 3's 12-token prompt is longer than a graph's span.
    let mut long = Batch::default();
    long.push(3, 0, &tokens(3, 12), OutputRows::All);
    kv.allocate(3, 64).unwrap();
    model.forward(&long, &mut kv).unwrap();
    assert!(!kv.take_hidden_written(), "an eager prompt pass");
    let lens = [5usize, 1, 9];
    let mut prefill = Batch::default();
    for (i, &n) in lens.iter().enumerate() {
        kv.allocate(i as u32, 64).unwrap();
        prefill.push(i as u32, 0, &tokens(i, n), OutputRows::All);
    }
    let hidden = model.forward(&prefill, &mut kv).unwrap();
    assert_eq!(
        kv.take_hidden_written(),
        graphs,
        "a graph-shaped prompt pass"
    );
    if graphs {
        let mut row = 0;
        for (i, &n) in lens.iter().enumerate() {
            let stored = kv.hidden(i as u32, 0, n).unwrap();
            assert_eq!(
                host(stored),
                host(hidden.narrow(0, row, n).unwrap()),
                "prompt {i}"
            );
            row += n;
        }
    }
    for step in 0..4 {
        let mut decode = Batch::default();
        for (i, &n) in lens.iter().enumerate() {
            let token = (step as u32 * 3 + i as u32) % 97;
            decode.push(i as u32, n + step, &[token], OutputRows::All);
        }
        let hidden = model.forward(&decode, &mut kv).unwrap();
        assert_eq!(kv.take_hidden_written(), graphs, "step {step}");
        assert!(!kv.take_hidden_written(), "told once");
        if graphs {
            for (i, &n) in lens.iter().enumerate() {
                let stored = kv.hidden(i as u32, n + step, n + step + 1).unwrap();
                let want = hidden.narrow(0, i, 1).unwrap();
                assert_eq!(host(stored), host(want), "step {step}, sequence {i}");
            }
        }
    }
    if graphs {
        let stats = model.cuda_graph_stats();
        assert!(stats.captures > 0 && stats.replays > 0, "{stats:?}");
    }
}

/// An MTP head's rounds replayed from CUDA graphs equal its eager rounds:
/// the same drafts (each row's argmax, computed inside the graph) and the
/// same logits bit for bit, over round 0's pending pairs (one to three a
/// slot, read for the last) and later rounds of one pair a slot, for one
/// and for three slots, while the slots' head KV grows and its speculative
/// entries are rolled back. Without a GPU both heads run the eager path.
#[test]
fn mtp_head_round_replays_equal_eager_rounds() {
    use tandem::model::MtpHead;
    let Some(Stories { dir, .. }) = stories260k() else {
        return;
    };
    let device = test_device();
    let target = Model::from_dir(&dir, &options(&device, DType::F32)).unwrap();
    let head = |graphs: bool| {
        let h = MtpHead::random(&target, 7).unwrap();
        h.set_cuda_graphs(graphs);
        h
    };
    let (hidden_size, vocab) = (target.config().hidden_size, target.config().vocab_size);
    let run = |head: &mut MtpHead| -> Vec<(Vec<u32>, Vec<f32>)> {
        let mut out = Vec::new();
        let mut record = |logits: tandem::model::DraftLogits, rows: usize| {
            let best = logits.argmax(&(0..rows).collect::<Vec<_>>()).unwrap();
            let all = logits.widened_all().unwrap();
            out.push((best.clone(), all.flatten_all().unwrap().to_vec1().unwrap()));
            best
        };
        for slot in 0..3 {
            head.admit(slot, 256).unwrap();
        }
        for step in 0..8usize {
            let slots = if step % 3 == 0 { 1 } else { 3 };
            let mut batch = Batch::default();
            for slot in 0..slots {
                let pairs = 1 + (step + slot) % 3;
                let start = head.len(slot as u32).unwrap();
                let tokens: Vec<u32> = (0..pairs)
                    .map(|j| ((start + j) * 7 + slot) as u32 % vocab as u32)
                    .collect();
                batch.push(slot as u32, start, &tokens, OutputRows::Last);
            }
            let rows = batch.tokens.len();
            let values = (0..rows * hidden_size)
                .map(|i| ((i * 31 + step) as f32 * 0.37).sin())
                .collect();
            let hidden = Tensor::from_vec(values, (rows, hidden_size), &device).unwrap();
            let logits = head.step_logits(&target, &batch, Some(&hidden)).unwrap();
            let kept: Vec<usize> = (0..slots).map(|s| head.len(s as u32).unwrap()).collect();
            let mut drafts = record(logits, slots);
            for _round in 1..4 {
                let mut batch = Batch::default();
                for (slot, &token) in drafts.iter().enumerate() {
                    let at = head.len(slot as u32).unwrap();
                    batch.push(slot as u32, at, &[token], OutputRows::Last);
                }
                let logits = head.step_logits(&target, &batch, None).unwrap();
                drafts = record(logits, slots);
            }
            for (slot, &len) in kept.iter().enumerate() {
                head.truncate(slot as u32, len).unwrap();
            }
        }
        out
    };
    let (mut eager, mut graphed) = (head(false), head(true));
    let want = run(&mut eager);
    let got = run(&mut graphed);
    assert_eq!(got.len(), want.len());
    for (round, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.0, w.0, "drafts of round {round}");
        assert!(g.1 == w.1, "logits of round {round} differ");
    }
    let stats = graphed.cuda_graph_stats();
    assert_eq!(eager.cuda_graph_stats(), Default::default());
    if device.is_cuda() && cfg!(feature = "cuda") {
        eprintln!("head round graphs: {stats:?}");
        assert!(stats.captures > 0 && stats.replays > 0, "{stats:?}");
        assert!(
            stats.verify_replays > 0,
            "round 0's pending pairs: {stats:?}"
        );
    } else {
        assert_eq!(stats, Default::default());
    }
}

/// Half-precision weights on a GPU: the run completes and its greedy
/// tokens mostly agree with f32 (reported, loosely bounded: rounding may
/// flip near-ties). On the CPU there is no bf16 compute, so this checks
/// only f16.
#[test]
fn half_precision_agrees_with_f32() {
    let Some(Stories {
        dir,
        prompts,
        generated: want,
    }) = stories260k()
    else {
        return;
    };
    let device = test_device();
    let dtypes: &[DType] = if device.is_cpu() {
        &[DType::F16]
    } else {
        &[DType::F16, DType::BF16]
    };
    for &dtype in dtypes {
        let model = Model::from_dir(&dir, &options(&device, dtype)).unwrap();
        let mut engine = engine_for(model);
        let reqs: Vec<Req> = prompts
            .iter()
            .map(|p| Req::new(p.clone(), SamplingOptions::greedy(), 64))
            .collect();
        let got = run_tokens(&mut engine, &reqs, 512);
        let (mut same, mut total) = (0, 0);
        for (g, w) in got.iter().zip(&want) {
            let g = ids(g);
            same += g.iter().zip(w).filter(|(a, b)| a == b).count();
            total += w.len();
        }
        let agreement = same as f64 / total as f64;
        eprintln!("{dtype:?} greedy agreement with the f32 reference: {agreement:.3}");
        assert!(agreement >= 0.5, "{dtype:?}: agreement {agreement:.3}");
    }
}

/// Pseudo-random logits `[rows, vocab]`: roughly normal with spread
/// `scale`; `quantum > 0` rounds them to multiples of it (ties).
fn random_logits(seed: u64, rows: usize, vocab: usize, scale: f32, quantum: f32) -> Vec<f32> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..rows * vocab)
        .map(|_| {
            let x: f32 = (0..4).map(|_| rng.random::<f32>() - 0.5).sum::<f32>() * scale;
            if quantum > 0.0 {
                (x / quantum).round() * quantum
            } else {
                x
            }
        })
        .collect()
}

/// The same call on a host sampler and on a device sampler: equal tokens,
/// logprobs and histories.
fn sample_both(
    host: &mut Sampler,
    dev: &mut Sampler,
    device: &Device,
    slots: &[u32],
    logits: Vec<f32>,
    vocab: usize,
    what: &str,
) {
    let cpu = Tensor::from_vec(logits, (slots.len(), vocab), &Device::Cpu).unwrap();
    let on_device = cpu.to_device(device).unwrap();
    // What speculative decoding asks of plain greedy rows: the first
    // maximum of each row, the same on both sides (ties included).
    let argmax = dev.argmax_rows(slots, &on_device).unwrap();
    assert_eq!(
        argmax,
        host.argmax_rows(slots, &cpu).unwrap(),
        "{what}: argmax rows"
    );
    let want = host.sample(slots, &cpu).unwrap();
    let got = dev.sample(slots, &on_device).unwrap();
    for (row, &s) in slots.iter().enumerate() {
        if host.is_plain_greedy(s) {
            assert_eq!(
                argmax[row], want.tokens[row],
                "{what}: plain greedy slot {s}"
            );
        }
    }
    assert_eq!(got.tokens, want.tokens, "{what}: tokens");
    match (&got.logprobs, &want.logprobs) {
        (Some(g), Some(w)) => assert!(max_abs_diff(g, w) < 1e-4, "{what}: {g:?} vs {w:?}"),
        (g, w) => assert_eq!(g.is_some(), w.is_some(), "{what}: logprobs presence"),
    }
    match (&got.top_logprobs, &want.top_logprobs) {
        (Some(g), Some(w)) => {
            for (gr, wr) in g.iter().zip(w) {
                let ids = |r: &[(u32, f32)]| r.iter().map(|p| p.0).collect::<Vec<_>>();
                let lps = |r: &[(u32, f32)]| r.iter().map(|p| p.1).collect::<Vec<_>>();
                assert_eq!(ids(gr), ids(wr), "{what}: top ids");
                assert!(
                    max_abs_diff(&lps(gr), &lps(wr)) < 1e-4,
                    "{what}: top logprobs"
                );
            }
        }
        (g, w) => assert_eq!(g.is_some(), w.is_some(), "{what}: top list presence"),
    }
    for &s in slots {
        assert_eq!(
            dev.history(s),
            host.history(s),
            "{what}: history of slot {s}"
        );
    }
}

/// On a GPU the sampler runs as one kernel launch per call (only ids and
/// logprobs come back) and keeps the penalty rings on the device. It must
/// draw exactly what the host sampler draws from the same logits and RNG
/// states: every transform alone and combined, ties, penalties over many
/// steps with rings wrapping, logprobs, subsets out of order, slots leaving
/// and joining, and commits between calls. Without a GPU both samplers take
/// the host path, so there this checks only determinism and `argmax_rows`
/// against `sample`; the kernel is checked by the GPU run
/// (`bench/gpu/run_h200.sh`).
#[test]
fn device_sampler_equals_host_sampler() {
    let device = test_device();
    let vocab = 3001;
    let o = |t: f32, k: i32, p: f32, min_p: f32, seed: u64| SamplingOptions {
        temperature: t,
        top_k: k,
        top_p: p,
        min_p,
        seed: Some(seed),
        ..Default::default()
    };
    let penalised = |base: SamplingOptions, window: i32| SamplingOptions {
        repeat_penalty: 1.3,
        presence_penalty: 0.4,
        frequency_penalty: 0.2,
        repeat_last_n: window,
        ..base
    };
    let options = [
        SamplingOptions::greedy(),
        penalised(SamplingOptions::greedy(), 8),
        o(0.9, 40, 1.0, 0.0, 1),
        o(1.1, 0, 0.8, 0.0, 2),
        o(0.7, 20, 0.95, 0.05, 3),
        o(1.0, 0, 1.0, 0.1, 4),
        o(1.0, 0, 1.0, 0.0, 5),
        penalised(o(0.8, 0, 0.9, 0.0, 6), 6),
        SamplingOptions {
            logprobs: true,
            top_logprobs: 5,
            ..o(0.6, 50, 1.0, 0.0, 7)
        },
        o(1.5, 1, 1.0, 0.0, 8),
        penalised(o(1.2, 7, 0.7, 0.02, 9), 32),
    ];
    let mut host = Sampler::with_seed(64, 11);
    let mut dev = Sampler::with_seed(64, 11);
    let mut slots: Vec<u32> = Vec::new();
    for (i, opt) in options.iter().enumerate() {
        let prior = prompt(i as u32, 20, vocab as u32);
        host.add(i as u32, *opt, &prior).unwrap();
        dev.add(i as u32, *opt, &prior).unwrap();
        slots.push(i as u32);
    }
    for step in 0..14u64 {
        if step == 4 {
            for s in [&mut host, &mut dev] {
                assert!(s.remove(2));
                s.add(100, penalised(o(0.9, 0, 0.85, 0.0, 12), 4), &[1, 2, 3, 1])
                    .unwrap();
            }
            slots.retain(|&s| s != 2);
            slots.push(100);
        }
        if step == 7 {
            for s in [&mut host, &mut dev] {
                s.commit(7, &[5, 6, 5]).unwrap();
                s.commit(1, &[9]).unwrap();
            }
        }
        // Every other call names a subset, out of order.
        let mut named = slots.clone();
        if step % 2 == 1 {
            named.reverse();
            named.remove(step as usize % named.len());
        }
        // Some calls have ties everywhere (logits in steps of 0.5).
        let quantum = if step % 3 == 2 { 0.5 } else { 0.0 };
        let logits = random_logits(step, named.len(), vocab, 6.0, quantum);
        sample_both(
            &mut host,
            &mut dev,
            &device,
            &named,
            logits,
            vocab,
            &format!("step {step}"),
        );
    }
}

/// Bad rows fail the device call with the host sampler's errors, and a
/// failed call changes nothing: the next good call draws what it would
/// have drawn without the failure.
#[test]
fn device_sampler_reports_bad_rows_and_commits_nothing() {
    let device = test_device();
    let vocab = 500;
    let sampled = SamplingOptions {
        temperature: 1.0,
        repeat_penalty: 1.2,
        repeat_last_n: 8,
        seed: Some(3),
        ..Default::default()
    };
    let fresh = || {
        let mut s = Sampler::with_seed(64, 1);
        s.add(10, SamplingOptions::greedy(), &[]).unwrap();
        s.add(11, sampled, &[4, 5]).unwrap();
        s
    };
    let to_device = |v: Vec<f32>| {
        Tensor::from_vec(v, (2, vocab), &Device::Cpu)
            .unwrap()
            .to_device(&device)
            .unwrap()
    };
    let good = random_logits(1, 2, vocab, 4.0, 0.0);
    let mut untouched = fresh();
    let want = untouched
        .sample(&[10, 11], &to_device(good.clone()))
        .unwrap();

    let mut s = fresh();
    let mut nan = good.clone();
    nan[vocab + 17] = f32::NAN;
    assert_eq!(
        s.sample(&[10, 11], &to_device(nan)),
        Err(SamplerError::NonFiniteLogits { slot: 11, row: 1 })
    );
    let mut nan_first = good.clone();
    nan_first[3] = f32::NAN;
    assert_eq!(
        s.argmax_rows(&[10, 11], &to_device(nan_first)),
        Err(SamplerError::NonFiniteLogits { slot: 10, row: 0 })
    );
    let mut dead = good.clone();
    dead[..vocab].fill(f32::NEG_INFINITY);
    assert_eq!(
        s.sample(&[10, 11], &to_device(dead)),
        Err(SamplerError::NoFiniteLogit { slot: 10, row: 0 })
    );
    let got = s.sample(&[10, 11], &to_device(good.clone())).unwrap();
    assert_eq!(got.tokens, want.tokens, "failed calls changed nothing");
    assert_eq!(s.history(11), untouched.history(11));

    s.commit(11, &[vocab as u32 + 3]).unwrap();
    assert_eq!(
        s.sample(&[11, 10], &to_device(good)),
        Err(SamplerError::VocabMismatch {
            slot: 11,
            token: vocab as u32 + 3,
            vocab
        })
    );
}

/// Grammar masks and logit biases on the device: the same tokens,
/// logprobs and histories as the host chain, with masks that allow a few
/// tokens, most tokens, or only tokens the bias pushes down, beside
/// unmasked rows in the same call; masks shorter than the row (the padding
/// past a tokenizer's vocabulary is disallowed); a bias id outside the row
/// fails the call with the host's error and commits nothing.
#[test]
fn device_sampler_applies_masks_and_biases_like_the_host() {
    use tandem::sampler::{LogitBias, TokenMask};
    let device = test_device();
    let vocab = 3001;
    let sampled = |seed: u64, top_k: i32, top_p: f32| SamplingOptions {
        temperature: 0.9,
        top_k,
        top_p,
        seed: Some(seed),
        ..Default::default()
    };
    let options = [
        SamplingOptions::greedy(),
        sampled(1, 40, 1.0),
        sampled(2, 0, 0.9),
        SamplingOptions {
            repeat_penalty: 1.3,
            repeat_last_n: 8,
            logprobs: true,
            top_logprobs: 3,
            ..sampled(3, 20, 0.95)
        },
        SamplingOptions::greedy(),
        sampled(4, 0, 1.0),
    ];
    let biases = [
        LogitBias::new([(7, 5.0), (2999, -100.0)]),
        LogitBias::default(),
        LogitBias::new([(11, 100.0), (12, 100.0)]),
        LogitBias::new([(3000, 3.0)]),
        LogitBias::new([(1, f32::MAX)]),
        LogitBias::default(),
    ];
    let mut host = Sampler::with_seed(64, 5);
    let mut dev = Sampler::with_seed(64, 5);
    let slots: Vec<u32> = (0..options.len() as u32).collect();
    for (i, (opt, bias)) in options.iter().zip(&biases).enumerate() {
        for s in [&mut host, &mut dev] {
            s.add(i as u32, *opt, &prompt(i as u32, 10, vocab as u32))
                .unwrap();
            s.set_logit_bias(i as u32, bias.clone()).unwrap();
        }
    }
    let few = TokenMask::allowing(&[3, 11, 500, 2999, 3000]);
    let most = TokenMask::allowing(&(0..vocab as u32).filter(|t| t % 7 != 0).collect::<Vec<_>>());
    let short = TokenMask::allowing(&(0..40).collect::<Vec<_>>());
    let pushed_down = TokenMask::allowing(&[2999]);
    for step in 0..8u64 {
        let masks: Vec<Option<&TokenMask>> = match step % 4 {
            0 => vec![
                Some(&few),
                None,
                Some(&most),
                Some(&short),
                None,
                Some(&few),
            ],
            1 => vec![
                Some(&pushed_down),
                Some(&most),
                None,
                Some(&few),
                Some(&most),
                None,
            ],
            2 => vec![None; slots.len()],
            _ => vec![
                Some(&short),
                Some(&short),
                Some(&few),
                Some(&most),
                Some(&few),
                Some(&most),
            ],
        };
        let quantum = if step % 3 == 2 { 0.5 } else { 0.0 };
        let cpu = Tensor::from_vec(
            random_logits(100 + step, slots.len(), vocab, 6.0, quantum),
            (slots.len(), vocab),
            &Device::Cpu,
        )
        .unwrap();
        let want = host.sample_masked(&slots, &cpu, &masks).unwrap();
        let got = dev
            .sample_masked(&slots, &cpu.to_device(&device).unwrap(), &masks)
            .unwrap();
        assert_eq!(got.tokens, want.tokens, "step {step}: tokens");
        for (row, mask) in masks.iter().enumerate() {
            if let Some(mask) = mask {
                assert!(mask.allows(got.tokens[row]), "step {step} row {row}");
            }
        }
        let (g, w) = (got.logprobs.unwrap(), want.logprobs.unwrap());
        assert!(max_abs_diff(&g, &w) < 1e-4, "step {step}: logprobs");
        for &s in &slots {
            assert_eq!(dev.history(s), host.history(s), "step {step}: slot {s}");
        }
    }

    // A bias id past the row: the host's error, and nothing committed.
    for s in [&mut host, &mut dev] {
        s.set_logit_bias(
            5,
            LogitBias::new([(2, 1.0), (vocab as u32 + 9, 1.0), (vocab as u32 + 4, 1.0)]),
        )
        .unwrap();
    }
    let cpu = Tensor::from_vec(
        random_logits(7, slots.len(), vocab, 6.0, 0.0),
        (slots.len(), vocab),
        &Device::Cpu,
    )
    .unwrap();
    let want_err = SamplerError::VocabMismatch {
        slot: 5,
        token: vocab as u32 + 4,
        vocab,
    };
    assert_eq!(host.sample(&slots, &cpu), Err(want_err.clone()));
    let on_device = cpu.to_device(&device).unwrap();
    assert_eq!(dev.sample(&slots, &on_device), Err(want_err));
    for s in [&mut host, &mut dev] {
        s.set_logit_bias(5, LogitBias::default()).unwrap();
    }
    let want = host.sample(&slots, &cpu).unwrap();
    let got = dev.sample(&slots, &on_device).unwrap();
    assert_eq!(got.tokens, want.tokens, "after the failed call");
}
