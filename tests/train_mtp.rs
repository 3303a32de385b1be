//! Self-distilled MTP head training: it learns, the saved head loads and
//! keeps greedy output exact, and a resumed run follows the same curve.

mod support;

use support::engine_driver::{run, Req};
use tandem::engine::*;
use tandem::model::{Model, MtpHead};
use tandem::sampler::SamplingOptions;
use tandem::tiny::{tiny_model_cpu, TinyPreset};
use tandem::train::{TrainConfig, TrainError, Trainer};

fn target() -> Model {
    tiny_model_cpu(TinyPreset::Test).unwrap().0
}

fn config(steps: usize) -> TrainConfig {
    TrainConfig {
        steps,
        batch: 8,
        seq_len: 24,
        lr: 3e-3,
        train_seqs: 96,
        heldout_seqs: 16,
        eval_every: 1000,
        checkpoint_every: 0,
        draft_positions: 3,
        ..Default::default()
    }
}

fn out_dir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("tandem-train-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn training_lowers_heldout_loss_and_raises_agreement() {
    let model = target();
    let mut trainer = Trainer::new(&model, config(150)).unwrap();
    let before = trainer.evaluate().unwrap();
    let dir = out_dir("learn");
    let report = trainer.run(&dir, |_, _, _| {}).unwrap();
    let after = report.evals.last().unwrap();
    eprintln!(
        "held-out loss {:.3} -> {:.3}, top-1 {:.3} -> {:.3}, acceptance {:?}",
        before.loss, after.loss, before.top1, after.top1, report.acceptance
    );
    assert!(
        after.loss < before.loss - 1.0,
        "loss must drop clearly: {} -> {}",
        before.loss,
        after.loss
    );
    assert!(
        after.top1 > before.top1 + 0.25,
        "agreement must rise well above the untrained head: {} -> {}",
        before.top1,
        after.top1
    );
    assert!(
        report.acceptance[0] > 0.2,
        "first-draft acceptance {:?}",
        report.acceptance
    );
    assert!(
        report.acceptance.windows(2).all(|w| w[1] <= w[0]),
        "acceptance by position is non-increasing"
    );

    // The saved head loads through the MTP loader and keeps greedy exact.
    let head = MtpHead::from_dir(&model, &dir).unwrap();
    let spec = Some(SpecOptions::constant(3));
    let reqs: Vec<Req> = (0..8u32)
        .map(|i| Req {
            prompt: vec![1, 20 + i, 40 + i],
            sampling: SamplingOptions::greedy(),
            max_new: 20,
            spec,
        })
        .collect();
    let plain = run(
        &mut Engine::new(
            target(),
            EngineConfig {
                kv_capacity_tokens: 4096,
                model_name: "t".into(),
                eos_ids: vec![],
                ..Default::default()
            },
        ),
        &reqs,
        8,
    );
    let mut engine = Engine::new(
        model,
        EngineConfig {
            kv_capacity_tokens: 4096,
            model_name: "t".into(),
            eos_ids: vec![],
            ..Default::default()
        },
    )
    .with_draft(Box::new(MtpDraft { head }), SpecConfig::default());
    let got = run(&mut engine, &reqs, 8);
    for i in 0..reqs.len() {
        assert_eq!(got.ids(i), plain.ids(i), "request {i}");
    }
    let (d, a): (usize, usize) = (got.drafted.iter().sum(), got.accepted.iter().sum());
    eprintln!(
        "trained head in the engine: acceptance {:.3} ({a}/{d})",
        a as f64 / d as f64
    );
    assert!(a > 0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn resuming_continues_the_same_loss_curve() {
    let model = target();
    let cfg = TrainConfig {
        checkpoint_every: 10,
        ..config(20)
    };
    let mut straight = Trainer::new(&model, cfg.clone()).unwrap();
    let full: Vec<f64> = (0..20).map(|_| straight.train_step().unwrap()).collect();

    let dir = out_dir("resume");
    let mut first = Trainer::new(&model, cfg).unwrap();
    for _ in 0..10 {
        first.train_step().unwrap();
    }
    first.save_checkpoint(&dir).unwrap();
    drop(first);
    let mut resumed = Trainer::resume(&model, &dir).unwrap();
    assert_eq!(resumed.step(), 10);
    let rest: Vec<f64> = (0..10).map(|_| resumed.train_step().unwrap()).collect();
    for (i, (a, b)) in full[10..].iter().zip(&rest).enumerate() {
        assert!((a - b).abs() < 1e-4, "step {}: {a} vs {b}", 10 + i);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_options_and_models_are_clear_errors() {
    let model = target();
    let err = Trainer::new(
        &model,
        TrainConfig {
            seq_len: 4,
            ..config(1)
        },
    )
    .err()
    .unwrap();
    assert!(
        matches!(
            err,
            TrainError::InvalidOption {
                field: "seq_len",
                ..
            }
        ),
        "{err}"
    );
    let err = Trainer::new(
        &model,
        TrainConfig {
            lr: -1.0,
            ..config(1)
        },
    )
    .err()
    .unwrap();
    assert!(err.to_string().contains("lr"), "{err}");
    let err = Trainer::new(
        &model,
        TrainConfig {
            seq_len: 5000,
            ..config(1)
        },
    )
    .err()
    .unwrap();
    assert!(err.to_string().contains("context"), "{err}");
}
