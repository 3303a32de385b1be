//! What one MTP head draft round costs against one target decode pass, on
//! this machine: the issue-18 budget is a draft token at most a tenth of a
//! target step.
//!
//! `cargo run --release --example head_round_cost -- MODEL.gguf HEAD_DIR [FORMAT]`
//!
//! `FORMAT` is the target's weight format (`q8_0` by default; `as-stored`,
//! `f32`, …). Feeds one sequence a 64-token prompt, catches the head up
//! with it, then times (medians of 200 after 20 untimed) a later round of
//! one pair (a draft fed back), rounds 0 of 1–6 pairs (a step that
//! verified drafts feeds the head the accepted ones too), and the target's
//! decode pass with its unembedding. Timings include the argmax a greedy
//! draft reads.

use std::path::Path;
use std::time::Instant;

use candle_core::{Device, Tensor};
use tandem::kv::KvCache;
use tandem::model::{Batch, LoadOptions, Model, MtpHead, OutputRows, WeightFormat};

const SLOT: u32 = 0;
const PROMPT: usize = 64;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 2 {
        eprintln!("usage: head_round_cost MODEL.gguf HEAD_DIR [FORMAT]");
        std::process::exit(2);
    }
    let format: WeightFormat = match args.get(2).map_or(Ok(WeightFormat::Q8_0), |f| f.parse()) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("format: {e}");
            std::process::exit(2);
        }
    };
    let opts = LoadOptions {
        weight_format: format,
        ..LoadOptions::default()
    };
    let target = Model::from_gguf(Path::new(&args[0]), &opts).unwrap_or_else(|e| {
        eprintln!("{}: {e}", args[0]);
        std::process::exit(1);
    });
    let mut head = MtpHead::from_dir(&target, Path::new(&args[1])).unwrap_or_else(|e| {
        eprintln!("{}: {e}", args[1]);
        std::process::exit(1);
    });
    let mut kv = KvCache::new(target.kv_layout(), Device::Cpu, 1 << 20);
    kv.allocate(SLOT, 4096).expect("room");
    head.admit(SLOT, 4096).expect("room");
    let prompt: Vec<u32> = (0..PROMPT as u32).map(|i| 100 + i * 7).collect();
    let mut batch = Batch::default();
    batch.push(SLOT, 0, &prompt, OutputRows::All);
    let hidden = target.forward(&batch, &mut kv).expect("prompt pass");

    // Round 0 of `k` pairs ending at the prompt's end: (h_t, x_{t+1}).
    let mut round0 = |k: usize| {
        let start = PROMPT - 1 - k;
        head.truncate(SLOT, start).expect("truncate");
        let mut b = Batch::default();
        b.push(SLOT, start, &prompt[start + 1..PROMPT], OutputRows::Last);
        let h = hidden.narrow(0, start, k).expect("rows");
        let t = Instant::now();
        let logits = head.step_logits(&target, &b, Some(&h)).expect("round");
        logits.argmax(&[0]).expect("argmax");
        t.elapsed().as_secs_f64() * 1e3
    };
    let first = round0(PROMPT - 1);
    println!(
        "first round 0 ({} pairs, one-offs included): {first:.3} ms",
        PROMPT - 1
    );
    for k in [1, 2, 3, 4, 6] {
        let ms = median((0..220).map(|_| round0(k)).skip(20).collect());
        println!("round 0 of {k} pair(s): median {ms:.3} ms");
    }
    // Later rounds: one pair each, the previous projected hidden fed back.
    head.truncate(SLOT, PROMPT - 1).expect("truncate");
    let mut at = PROMPT - 1;
    let later: Vec<f64> = (0..220)
        .map(|i| {
            if at >= PROMPT + 8 {
                head.truncate(SLOT, PROMPT - 1).expect("truncate");
                at = PROMPT - 1;
            }
            let mut b = Batch::default();
            b.push(SLOT, at, &[prompt[i % PROMPT]], OutputRows::Last);
            let t = Instant::now();
            let logits = head.step_logits(&target, &b, None).expect("round");
            logits.argmax(&[0]).expect("argmax");
            at += 1;
            t.elapsed().as_secs_f64() * 1e3
        })
        .skip(20)
        .collect();
    let later = median(later);
    println!("later round (1 pair): median {later:.3} ms");
    let passes: Vec<f64> = (0..120)
        .map(|i| {
            let mut b = Batch::default();
            b.push(SLOT, PROMPT + i, &[prompt[i % PROMPT]], OutputRows::Last);
            let t = Instant::now();
            let x = target.forward(&b, &mut kv).expect("decode pass");
            let logits: Tensor = target.unembed(&x).expect("unembed");
            drop(logits);
            t.elapsed().as_secs_f64() * 1e3
        })
        .skip(20)
        .collect();
    let pass = median(passes);
    println!(
        "target decode pass + unembedding: median {pass:.3} ms; a later round is {:.1} % of it",
        100.0 * later / pass
    );
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
