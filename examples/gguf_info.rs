//! Prints a GGUF file's metadata (long arrays abbreviated) and tensor infos,
//! and how long parsing took.
//!
//! `cargo run --release --example gguf_info -- FILE.gguf [--tensors]`

use std::time::Instant;

use tandem::gguf::{GgufFile, Value};

fn main() {
    let mut args = std::env::args().skip(1);
    let Some(path) = args.next() else {
        eprintln!("usage: gguf_info FILE.gguf [--tensors]");
        std::process::exit(2);
    };
    let show_tensors = args.any(|a| a == "--tensors");
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
}
