//! Tandem embedded in a host service: an actix-web app whose route streams a
//! completion from the scheduler, which runs in the same actix System.
//!
//! ```text
//! cargo run --release --example embed_in_service            # listens on 127.0.0.1:8088
//! curl -N -d '{"prompt":"hello","max_tokens":32}' -H 'content-type: application/json' 127.0.0.1:8088/complete
//! ```
//! `--self-test` starts the service on an ephemeral port, sends one request
//! to itself, prints the streamed text and exits.

use actix_web::{web, App, HttpResponse, HttpServer};
use futures_util::StreamExt;
use serde::Deserialize;
use tandem::api::{Event, GenerateRequest};
use tandem::engine::{Engine, EngineConfig};
use tandem::scheduler::{SchedulerConfig, ShutdownMode};
use tandem::tiny::{tiny_model_cpu, TinyPreset};
use tandem::TandemHandle;

#[derive(Deserialize)]
struct CompleteBody {
    prompt: String,
    #[serde(default = "default_max_tokens")]
    max_tokens: usize,
}

fn default_max_tokens() -> usize {
    32
}

/// Streams the completion as plain text, chunk by chunk. Dropping the
/// response (client gone) drops the event stream, which cancels the request.
async fn complete(handle: web::Data<TandemHandle>, body: web::Json<CompleteBody>) -> HttpResponse {
    let request = GenerateRequest::new(body.prompt.clone(), body.max_tokens);
    match handle.generate(request).await {
        Err(e) if e.is_invalid_request() => HttpResponse::BadRequest().body(format!("{e}\n")),
        Err(e) => HttpResponse::ServiceUnavailable().body(format!("{e}\n")),
        Ok(events) => {
            let body = events.map(|event| {
                let text = match event {
                    Event::Tokens { text, .. } => text,
                    Event::Finished(f) => format!(
                        "\n[{} after {} tokens]\n",
                        f.reason.as_str(),
                        f.usage.completion_tokens
                    ),
                    Event::Error { error, .. } => format!("\n[error: {error}]\n"),
                };
                Ok::<_, actix_web::Error>(web::Bytes::from(text))
            });
            HttpResponse::Ok()
                .content_type("text/plain; charset=utf-8")
                .streaming(body)
        }
    }
}

#[actix_web::main]
async fn main() -> std::io::Result<()> {
    let self_test = std::env::args().any(|a| a == "--self-test");
    let (model, tokenizer) = tiny_model_cpu(TinyPreset::Default).map_err(std::io::Error::other)?;
    let engine = Engine::new(
        model,
        EngineConfig {
            kv_capacity_tokens: 64 * 1024,
            model_name: "tandem-tiny".into(),
            eos_ids: tokenizer.eos_ids().to_vec(),
            ..Default::default()
        },
    );
    let handle = TandemHandle::start(engine, tokenizer, SchedulerConfig::default())
        .map_err(std::io::Error::other)?;

    let data = web::Data::new(handle.clone());
    let server = HttpServer::new(move || {
        App::new()
            .app_data(data.clone())
            .route("/complete", web::post().to(complete))
    })
    .workers(1)
    .bind(("127.0.0.1", if self_test { 0 } else { 8088 }))?;
    let addr = server.addrs()[0];
    println!("listening on http://{addr}");
    let server = server.run();
    if !self_test {
        return server.await;
    }
    let server_handle = server.handle();
    actix_web::rt::spawn(server);
    let text = tokio::task::spawn_blocking(move || {
        raw_post(addr, r#"{"prompt":"hello there","max_tokens":16}"#)
    })
    .await??;
    println!("streamed response:\n{text}");
    server_handle.stop(true).await;
    handle
        .shutdown(ShutdownMode::Drain)
        .await
        .map_err(std::io::Error::other)?;
    Ok(())
}

/// A minimal HTTP/1.1 client for the self-test (no extra dependency).
fn raw_post(addr: std::net::SocketAddr, body: &str) -> std::io::Result<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr)?;
    write!(s, "POST /complete HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len())?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out)
}
