//! Prints a GGUF file's metadata (long arrays abbreviated) and tensor infos,
//! and how long parsing took.
//!
//! `cargo run --release --example gguf_info -- FILE.gguf [--tensors] [--load]`
//!
//! `--load` also builds the model (f32 compute) and the tokenizer, timing
//! each phase.

use std::time::Instant;

use tandem::gguf::{GgufFile, Value};

fn main() {
    let mut args = std::env::args().skip(1);
    let Some(path) = args.next() else {
        eprintln!("usage: gguf_info FILE.gguf [--tensors]");
        std::process::exit(2);
    };
    let args: Vec<String> = args.collect();
    let show_tensors = args.iter().any(|a| a == "--tensors");
    let load = args.iter().any(|a| a == "--load");
    let t0 = Instant::now();
    let file = match GgufFile::open(path.as_ref()) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("{path}: {e}");
            std::process::exit(1);
        }
    };
    println!(
        "{path}: GGUF v{}, parsed in {:?}",
        file.version,
        t0.elapsed()
    );
    for (k, v) in file.metadata() {
        let shown = match v {
            Value::Array(t, items) if items.len() > 8 => {
                format!("[{:?}; {}] {:?} …", t, items.len(), &items[..4])
            }
            Value::String(s) if s.len() > 200 => {
                format!("{:?}…", s.chars().take(200).collect::<String>())
            }
            other => format!("{other:?}"),
        };
        println!("  {k} = {shown}");
    }
    println!("  {} tensors", file.tensors().len());
    if show_tensors {
        for t in file.tensors() {
            println!(
                "  {} {:?} {}",
                t.name,
                t.dims,
                t.ggml_type.name().unwrap_or("?")
            );
        }
    }
    if load {
        if let Err(e) = time_load(&file) {
            eprintln!("{path}: {e}");
            std::process::exit(1);
        }
    }
}

fn time_load(file: &GgufFile) -> Result<(), tandem::gguf::GgufError> {
    let t = Instant::now();
    let cfg = tandem::gguf::config_from_gguf(file)?;
    let (weights, _) =
        tandem::gguf::tensors::hf_weights(file, &cfg, tandem::gguf::tensors::Blocks::Dequantise)?;
    println!("dequantised every weight to f32 in {:?}", t.elapsed());
    let t = Instant::now();
    let model = tandem::model::Model::load(cfg, &weights, &Default::default())?;
    println!("Model::load (f32, lean CPU) in {:?}", t.elapsed());
    drop(weights);
    let t = Instant::now();
    let model2 = tandem::gguf::load_model(file, &Default::default())?;
    println!("load_model (both together) in {:?}", t.elapsed());
    drop((model, model2));
    let t = Instant::now();
    let tok = tandem::tokenizer::Tokenizer::from_gguf(file)?;
    println!("tokenizer ({} ids) in {:?}", tok.vocab_size(), t.elapsed());
    Ok(())
}
