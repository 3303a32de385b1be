//! Self-distilled MTP head training: it learns, the saved head loads and
//! keeps greedy output exact, and a resumed run follows the same curve.

mod support;

use candle_core::Tensor;
use support::engine_driver::{run, Req};
use tandem::engine::*;
use tandem::model::{Batch, Model, MtpHead, OutputRows};
use tandem::sampler::{argmax, SamplingOptions};
use tandem::tiny::{tiny_model_cpu, TinyPreset};
use tandem::train::data::Features;
use tandem::train::prompts::random_token_prompts;
use tandem::train::{evaluate_head, PromptSet, TrainConfig, TrainError, Trainer, Walk};

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

/// Random token prompts for `cfg` (the tiny model's words are not English).
fn prompts(model: &Model, cfg: &TrainConfig) -> PromptSet {
    let all = random_token_prompts(model.config(), cfg.train_seqs + cfg.heldout_seqs, cfg.seed);
    PromptSet::split(all, cfg.heldout_seqs).unwrap()
}

fn out_dir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("tandem-train-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Acceptance by draft position, one sequence and one position at a time
/// (the reference for `Trainer::acceptance`'s batched measurement).
fn acceptance_one_by_one(
    model: &Model,
    head: &mut MtpHead,
    heldout: &Features,
    k: usize,
) -> (Vec<f64>, Walk) {
    let step = |head: &mut MtpHead, slot, pos, token, hidden: Option<&Tensor>| {
        let mut b = Batch::default();
        b.push(slot, pos, &[token], OutputRows::Last);
        let logits = head.step(model, &b, hidden).unwrap();
        logits.get(0).unwrap().to_vec1::<f32>().unwrap()
    };
    let (mut hits, mut trials) = (vec![0usize; k], 0usize);
    let mut walk = Walk::default();
    for (n, seq) in heldout.sequences.iter().enumerate() {
        let slot = n as u32;
        head.admit(slot, seq.len() + k).unwrap();
        let hidden = heldout.hidden.get(n).unwrap();
        // Drafts accepted from each position from the answer's first token.
        let mut depths = Vec::new();
        for t in 0..heldout.lens[n].min(seq.len()) - 1 {
            let h = hidden.narrow(0, t, 1).unwrap();
            let mut logits = step(head, slot, t, seq[t + 1], Some(&h));
            if t + 2 < heldout.prompt_lens[n] || t + 1 + k >= heldout.lens[n] {
                continue;
            }
            trials += 1;
            let mut depth = 0;
            for r in 0..k {
                let d = argmax(&logits);
                if d != seq[t + 2 + r] {
                    break;
                }
                hits[r] += 1;
                depth += 1;
                if r + 1 < k {
                    logits = step(head, slot, t + 1 + r, d, None);
                }
            }
            if t + 1 >= heldout.prompt_lens[n] {
                depths.push(depth);
            }
            head.truncate(slot, t + 1).unwrap();
        }
        // The walk by hand: from each step's start, past its accepted
        // drafts and the target's own token.
        let mut i = 0;
        while i < depths.len() {
            walk.steps += 1;
            walk.accepted += depths[i];
            i += depths[i] + 1;
        }
        head.release(slot);
    }
    let by_position = hits
        .iter()
        .map(|&h| h as f64 / trials.max(1) as f64)
        .collect();
    (by_position, walk)
}

/// Runs `trainer` to the end (into a fresh directory named by `tag`) and
/// checks that the head learned: held-out loss down, agreement and
/// first-draft acceptance well above an untrained head's.
fn train_and_check_it_learns(
    trainer: &mut Trainer<'_>,
    tag: &str,
) -> (tandem::train::TrainReport, std::path::PathBuf) {
    let before = trainer.evaluate().unwrap();
    let dir = out_dir(tag);
    let report = trainer.run(&dir, |_, _, _| {}).unwrap();
    let after = report.evals.last().unwrap();
    eprintln!(
        "{tag}: held-out loss {:.3} -> {:.3}, top-1 {:.3} -> {:.3}, acceptance {:?}",
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
    (report, dir)
}

#[test]
fn training_lowers_heldout_loss_and_raises_agreement() {
    let model = target();
    let prompt_set = prompts(&model, &config(150));
    let mut trainer = Trainer::new(&model, config(150), &prompt_set).unwrap();
    let (report, dir) = train_and_check_it_learns(&mut trainer, "learn");
    assert!(
        report.acceptance.windows(2).all(|w| w[1] <= w[0]),
        "acceptance by position is non-increasing"
    );

    // The batched measurement is what drafting each sequence alone gives.
    let mut alone = MtpHead::from_dir(&model, &dir).unwrap();
    let k = report.acceptance.len();
    let (one_by_one, walk) = acceptance_one_by_one(&model, &mut alone, trainer.heldout(), k);
    assert_eq!(
        report.acceptance, one_by_one,
        "batched acceptance equals sequence-by-sequence drafting"
    );
    assert!(walk.steps > 0, "the held-out answers were walked");
    // `tandem eval-mtp`'s measurement of the saved head on the held-out
    // prompts is the report's.
    let (evaluated, scored) = evaluate_head(
        &model,
        &mut MtpHead::from_dir(&model, &dir).unwrap(),
        &prompt_set.heldout,
        config(150).seq_len,
        k,
    )
    .unwrap();
    assert_eq!(evaluated.by_position, report.acceptance);
    assert_eq!(
        evaluated.walk, walk,
        "the batched walk is the sequence-by-sequence one"
    );
    assert_eq!(scored, trainer.heldout().scored_labels().unwrap().len());

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

/// Every trained round is what the inference head computes in that draft
/// round, fed the real next tokens instead of its own drafts: round `r` of
/// base pair `i` sits at position `i + r - 1` and sees the real pairs
/// `0..=i` and its own earlier rounds, as the engine's draft rounds do. On
/// the candle path (the lean one runs the head in Q8_0), so both sides are
/// f32 and agree to rounding.
#[test]
fn each_trained_round_is_the_inference_heads_draft_round() {
    let model = tandem::tiny::tiny_model(
        TinyPreset::Test,
        &tandem::model::LoadOptions {
            dtype: candle_core::DType::F32,
            device: candle_core::Device::Cpu,
            lean_cpu: false,
            ..Default::default()
        },
    )
    .unwrap()
    .0;
    let cfg = TrainConfig {
        heldout_seqs: 3,
        ..config(1)
    };
    let trainer = Trainer::new(&model, cfg.clone(), &prompts(&model, &cfg)).unwrap();
    let f = trainer.heldout();
    let rounds = 4;
    let trainable = tandem::train::head::TrainableHead::new(&model, 7, None).unwrap();
    let trained: Vec<Vec<Vec<f32>>> = trainable
        .round_logits(f, rounds)
        .unwrap()
        .iter()
        .map(|l| l.to_vec2().unwrap())
        .collect();
    let mut head = MtpHead::from_tensors(
        &model,
        trainable.tensors().unwrap(),
        std::path::Path::new("<test>"),
    )
    .unwrap();
    let t = f.hidden.dim(1).unwrap();
    let mut worst = 0f32;
    let mut compared = 0;
    for (n, &len) in f.lens.iter().enumerate() {
        let slot = n as u32;
        let next: Vec<u32> = f.next_tokens.get(n).unwrap().to_vec1().unwrap();
        let hidden = f.hidden.get(n).unwrap();
        head.admit(slot, t + rounds).unwrap();
        for i in 0..len.saturating_sub(rounds) {
            for r in 0..rounds {
                let mut b = Batch::default();
                b.push(slot, i + r, &[next[i + r]], OutputRows::Last);
                let h = hidden.narrow(0, i, 1).unwrap();
                let got = head.step(&model, &b, (r == 0).then_some(&h)).unwrap();
                let got: Vec<f32> = got.get(0).unwrap().to_vec1().unwrap();
                let want = &trained[r][n * (t - r) + i];
                for (g, w) in got.iter().zip(want) {
                    worst = worst.max((g - w).abs() / (1.0 + w.abs()));
                }
                compared += 1;
            }
            head.truncate(slot, i + 1).unwrap();
        }
        head.release(slot);
    }
    eprintln!("{compared} rounds compared, worst relative difference {worst:e}");
    assert!(compared >= 3 * rounds * 4, "{compared}");
    assert!(worst < 1e-4, "trained rounds differ from drafting: {worst}");
}

/// Soft labels: pair `t`'s teacher is the target's unembedding of the next
/// pair's hidden state, so its argmax is the greedy label the data holds
/// (an off-by-one in the shift would agree only by chance); and a head
/// trained against those distributions learns as one trained on labels.
#[test]
fn soft_labels_are_the_distributions_the_greedy_labels_came_from() {
    let model = target();
    let cfg = TrainConfig {
        soft_labels: true,
        ..config(150)
    };
    let prompt_set = prompts(&model, &cfg);
    let mut trainer = Trainer::new(&model, cfg, &prompt_set).unwrap();

    let f = trainer.heldout();
    let head = tandem::train::head::TrainableHead::new(&model, 0, None).unwrap();
    let teacher = head.teacher_logits(f).unwrap();
    let pairs = teacher.dim(1).unwrap();
    let flat = |t: Tensor| t.flatten_all().unwrap();
    let picked: Vec<u32> = flat(teacher.argmax(2).unwrap()).to_vec1().unwrap();
    let labels: Vec<u32> = flat(f.labels.narrow(1, 0, pairs).unwrap())
        .to_vec1()
        .unwrap();
    let mask: Vec<f32> = flat(f.mask.narrow(1, 0, pairs).unwrap()).to_vec1().unwrap();
    let scored: Vec<bool> = picked
        .iter()
        .zip(&labels)
        .zip(&mask)
        .filter(|(_, &m)| m > 0.0)
        .map(|((p, l), _)| p == l)
        .collect();
    let agree = scored.iter().filter(|&&a| a).count() as f64 / scored.len() as f64;
    assert!(scored.len() > 100, "{} scored pairs", scored.len());
    assert!(
        agree > 0.99,
        "teacher argmax agrees with the greedy labels on {agree:.3}"
    );

    let (_, dir) = train_and_check_it_learns(&mut trainer, "soft");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn resuming_continues_the_same_loss_curve() {
    let model = target();
    let cfg = TrainConfig {
        checkpoint_every: 10,
        ..config(20)
    };
    let set = prompts(&model, &cfg);
    let mut straight = Trainer::new(&model, cfg.clone(), &set).unwrap();
    let full: Vec<f64> = (0..20).map(|_| straight.train_step().unwrap()).collect();

    let dir = out_dir("resume");
    let mut first = Trainer::new(&model, cfg, &set).unwrap();
    for _ in 0..10 {
        first.train_step().unwrap();
    }
    first.save_checkpoint(&dir).unwrap();
    // The checkpoint's head is servable as it stands (a stopped run's).
    let mut saved = MtpHead::from_dir(&model, &dir).unwrap();
    let mut live = first.head().unwrap();
    let mut batch = tandem::model::Batch::default();
    batch.push(0, 0, &[3, 5, 7], tandem::model::OutputRows::Last);
    let hidden = candle_core::Tensor::ones(
        (3, model.config().hidden_size),
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let logits: Vec<Vec<f32>> = [&mut saved, &mut live]
        .into_iter()
        .map(|head| {
            head.admit(0, 8).unwrap();
            let out = head.step(&model, &batch, Some(&hidden)).unwrap();
            out.flatten_all().unwrap().to_vec1().unwrap()
        })
        .collect();
    assert_eq!(
        logits[0], logits[1],
        "the checkpoint's mtp.safetensors is the trainer's head"
    );
    drop(first);
    let mut resumed = Trainer::resume(&model, &dir, &set).unwrap();
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
    let set = prompts(&model, &config(1));
    let rejected = |cfg: TrainConfig| Trainer::new(&model, cfg, &set).err().unwrap();
    let option = |err: &TrainError| match err {
        TrainError::InvalidOption { field, .. } => Some(*field),
        _ => None,
    };
    let err = rejected(TrainConfig {
        seq_len: 4,
        ..config(1)
    });
    assert_eq!(option(&err), Some("seq_len"), "{err}");
    let err = rejected(TrainConfig {
        lr: -1.0,
        ..config(1)
    });
    assert!(err.to_string().contains("lr"), "{err}");
    let err = rejected(TrainConfig {
        seq_len: 5000,
        ..config(1)
    });
    assert!(err.to_string().contains("context"), "{err}");
    let err = rejected(TrainConfig {
        rounds: 0,
        ..config(1)
    });
    assert_eq!(option(&err), Some("rounds"), "{err}");
}

#[test]
fn a_draft_vocab_head_trains_saves_its_vocab_and_drafts_inside_it() {
    let model = target();
    let cfg = TrainConfig {
        draft_vocab: 96,
        ..config(120)
    };
    let mut trainer = Trainer::new(&model, cfg.clone(), &prompts(&model, &cfg)).unwrap();
    let before = trainer.evaluate().unwrap();
    let dir = out_dir("vocab");
    let report = trainer.run(&dir, |_, _, _| {}).unwrap();
    let after = report.evals.last().unwrap();
    eprintln!(
        "draft vocab 96: held-out loss {:.3} -> {:.3}, top-1 {:.3} -> {:.3}, coverage {:.3}, acceptance {:?}",
        before.loss, after.loss, before.top1, after.top1, report.data.heldout_coverage, report.acceptance
    );
    assert_eq!(report.data.draft_vocab, 96);
    assert!(report.data.heldout_coverage > 0.5 && report.data.heldout_coverage < 1.0);
    assert!(
        after.loss < before.loss - 1.0,
        "{} -> {}",
        before.loss,
        after.loss
    );
    assert!(report.acceptance[0] > 0.2, "{:?}", report.acceptance);

    // The saved head holds the vocabulary and drafts only inside it.
    let mut head = MtpHead::from_dir(&model, &dir).unwrap();
    assert_eq!(head.draft_vocab_len(), Some(96));
    let saved = candle_core::safetensors::load(
        dir.join(tandem::model::mtp::MTP_FILE),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let ids: Vec<u32> = saved[tandem::model::mtp::DRAFT_VOCAB_TENSOR]
        .to_vec1()
        .unwrap();
    assert_eq!(ids.len(), 96);
    let heldout = trainer.heldout();
    let hidden = heldout.hidden.get(0).unwrap().narrow(0, 0, 1).unwrap();
    head.admit(0, 64).unwrap();
    let mut b = tandem::model::Batch::default();
    b.push(
        0,
        0,
        &[heldout.sequences[0][1]],
        tandem::model::OutputRows::Last,
    );
    let row: Vec<f32> = head
        .step(&model, &b, Some(&hidden))
        .unwrap()
        .get(0)
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(row.len(), model.config().vocab_size);
    for (id, x) in row.iter().enumerate() {
        assert_eq!(
            x.is_finite(),
            ids.binary_search(&(id as u32)).is_ok(),
            "id {id}: {x}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_data_scores_only_what_the_target_wrote() {
    let model = target();
    let cfg = config(1);
    let set = prompts(&model, &cfg);
    let trainer = Trainer::new(&model, cfg.clone(), &set).unwrap();
    let h = trainer.heldout();
    let mask: Vec<Vec<f32>> = h.mask.to_vec2().unwrap();
    for (i, seq) in h.sequences.iter().enumerate() {
        assert_eq!(seq.len(), cfg.seq_len);
        let p = h.prompt_lens[i];
        assert_eq!(&seq[..p], set.heldout[i].as_slice(), "the prompt leads");
        for (j, &m) in mask[i].iter().enumerate() {
            let want = j + 2 >= p && j + 1 < h.lens[i];
            assert_eq!(m > 0.0, want, "sequence {i}, pair {j}");
        }
    }
}

#[cfg(feature = "server")]
#[test]
fn builtin_prompts_are_rendered_through_the_chat_template() {
    use tandem::server::{ChatMessage, ChatTemplate};
    use tandem::train::prompts::{builtin, render_chat};
    let (_, tokenizer) = tiny_model_cpu(TinyPreset::Test).unwrap();
    let texts = builtin(5);
    assert_eq!(texts, builtin(5), "deterministic");
    let ids = render_chat(&tokenizer, &texts).unwrap();
    let template = ChatTemplate::from_tokenizer(&tokenizer).unwrap();
    for (t, got) in texts.iter().zip(&ids) {
        let text = template
            .render(&[ChatMessage::text("user", t.clone())], true)
            .unwrap();
        assert!(text.ends_with("Assistant:"), "{text:?}");
        assert_eq!(got, &tokenizer.encode(&text).unwrap());
    }

    // SmolLM2's own ChatML template, when the reference files are here.
    let Some(dir) = tandem::testing::shared("models/smollm2-135m-instruct") else {
        return;
    };
    let tokenizer = tandem::tokenizer::Tokenizer::from_dir(&dir).unwrap();
    let ids = render_chat(&tokenizer, &texts).unwrap();
    for (t, got) in texts.iter().zip(&ids) {
        let text = tokenizer.decode(got).unwrap_or_default();
        let raw = tokenizer.inner().decode(got, false).unwrap();
        assert!(raw.starts_with("<|im_start|>system\n"), "{raw:?}");
        assert!(
            raw.ends_with(&format!(
                "<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n"
            )),
            "{raw:?}"
        );
        assert!(text.contains(t.as_str()));
    }
}

/// The Magpie recipe on SmolLM2: continued from its chat template's user
/// cue, the model writes distinct requests, closed where its turn ends,
/// and the same ones again for the same seed.
#[cfg(feature = "server")]
#[test]
fn smollm2_writes_distinct_requests_of_its_own() {
    use tandem::train::prompts::self_prompts;
    let Some((gguf, _)) = support::reference::smollm2() else {
        return;
    };
    let model = Model::from_gguf(&gguf, &Default::default()).unwrap();
    let tokenizer = tandem::tokenizer::Tokenizer::from_gguf_path(&gguf).unwrap();
    // Sixteen: enough that some of what the model writes runs past the
    // budget unclosed (and must be dropped).
    let requests = self_prompts(&model, &tokenizer, 16, 11).unwrap();
    eprintln!("{requests:#?}");
    assert_eq!(requests.len(), 16);
    for r in &requests {
        assert_eq!(r.trim(), r, "trimmed");
        assert!(!r.is_empty());
        assert!(
            !r.contains("<|im_end|>") && !r.contains("<|im_start|>"),
            "{r:?}"
        );
        // Closed before the budget ran out (a request the model never
        // closed fills all of it).
        assert!(
            tokenizer.encode_plain(r).unwrap().len() < tandem::train::prompts::SELF_PROMPT_TOKENS,
            "{r:?}"
        );
    }
    let distinct: std::collections::HashSet<_> = requests.iter().collect();
    assert_eq!(distinct.len(), 16, "distinct");
    assert_eq!(
        self_prompts(&model, &tokenizer, 16, 11).unwrap(),
        requests,
        "seeded"
    );
    assert_ne!(self_prompts(&model, &tokenizer, 16, 12).unwrap(), requests);
}
