//! The real `tandem` binary: SIGTERM, startup errors, `generate`, the
//! official `openai` Python client, and a real checkpoint served end to end.

use super::*;

/// `1`: the `openai` Python client is promised (CI installed it), so a
/// failing `import openai` fails its test instead of skipping it.
const REQUIRE_OPENAI_CLIENT_VAR: &str = "TANDEM_REQUIRE_OPENAI_CLIENT";

/// The real binary: SIGTERM stops accepting, lets the in-flight stream
/// finish, and exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_drains_and_exits_0_on_sigterm() {
    let mut server = BinaryServer::spawn(&["--drain-timeout", "20"]);
    let c = client();
    let health = c.get(server.url("/health")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    let body = json!({"prompt": "drain me", "max_tokens": 200, "temperature": 0, "stream": true,
        "logprobs": 0});
    let mut r = c
        .post(server.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let mut seen = String::from_utf8_lossy(&r.chunk().await.unwrap().unwrap()).into_owned();
    server.signal("TERM");
    while let Some(bytes) = r.chunk().await.unwrap() {
        seen.push_str(&String::from_utf8_lossy(&bytes));
    }
    let chunks = sse_chunks(&seen);
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );
    let text: String = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap_or(""))
        .collect();
    // Unknown prompt words: the text still starts with the space that
    // separates it from the prompt (issue #20, defect 5).
    assert!(text.starts_with(' '), "{text:?}");
    let tokens: usize = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"]["tokens"].as_array())
        .map(Vec::len)
        .sum();
    assert_eq!(tokens, 200, "the whole completion arrived");
    drop(c); // close the keep-alive connection, so the workers can stop
    let status = server.wait_exit(Duration::from_secs(20)).expect("exited");
    assert_eq!(status.code(), Some(0));
}

#[test]
fn the_binary_refuses_bad_flags_at_startup() {
    for (args, needle) in [
        (
            &[
                "serve",
                "--embedded",
                "test",
                "--port",
                "0",
                "--mtp",
                "head:/m",
            ][..],
            "no MTP head here",
        ),
        (
            &[
                "serve",
                "--embedded",
                "test",
                "--port",
                "0",
                "--mtp",
                "early-exit:9",
            ][..],
            "has 2 layers",
        ),
        (&["serve", "--mtp", "sometimes"][..], "--mtp"),
        (
            &[
                "train-mtp",
                "--embedded",
                "test",
                "--out",
                "/tmp/tandem-never-written",
                "--self-prompts",
                "4",
            ][..],
            "--self-prompts need --model",
        ),
        (
            &[
                "eval-mtp",
                "--model",
                "/no/such/model",
                "--head",
                "/no/such/head",
                "--prompts",
                "/no/such/prompts",
            ][..],
            "/no/such/model",
        ),
        (&["serve", "--draft-max", "0"][..], "--draft-max"),
        (&["serve", "--device", "cuda"][..], "--device cuda"),
        (&["serve", "--dtype", "f64"][..], "--dtype f64"),
        (
            &["serve", "--model", "/no/such/model"][..],
            "--model /no/such/model: not a directory",
        ),
        (
            &["serve", "--max-seqs", "128", "--step-tokens", "64"][..],
            "--step-tokens",
        ),
        (
            &[
                "serve",
                "--embedded",
                "test",
                "--port",
                "0",
                "--body-timeout",
                "0",
            ][..],
            "--body-timeout",
        ),
        (
            &[
                "serve",
                "--embedded",
                "test",
                "--port",
                "0",
                "--header-timeout",
                "inf",
            ][..],
            "--header-timeout",
        ),
    ] {
        let (code, stderr) = run_binary(args);
        assert_eq!(code, Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
}

#[test]
fn the_binary_generates_to_the_terminal() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args([
            "generate",
            "--embedded",
            "test",
            "--max-tokens",
            "9",
            "--temperature",
            "0",
        ])
        .arg("hello there")
        .env("RUST_LOG", "warn")
        .output()
        .expect("run tandem generate");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    // (The vocabulary's glue tokens join words: count tokens, not words.)
    assert!(!text.trim().is_empty(), "{text}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("[length: 3 prompt + 9 generated tokens"));
}

/// The official `openai` Python client against the real binary.
#[test]
fn official_openai_client_end_to_end() {
    let probe = std::process::Command::new("python3")
        .args(["-c", "import openai"])
        .output();
    if !probe.is_ok_and(|o| o.status.success()) {
        tandem::testing::skip(
            REQUIRE_OPENAI_CLIENT_VAR,
            "official_openai_client_end_to_end: `python3 -c \"import openai\"` failed (pip install openai)",
        );
        return;
    }
    let server = BinaryServer::spawn(&["--api-key", "e2e-key"]);
    run_client_script(&server, "openai_client.py", &["e2e-key"]);
}

/// `tandem serve --model DIR` with a real trained checkpoint reproduces the
/// reference greedy text over HTTP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_serves_a_model_folder_with_reference_output() {
    let Some(dir) = tandem::testing::shared("models/stories260k") else {
        return;
    };
    let reference = std::fs::read_to_string(dir.join("reference.json")).expect("reference.json");
    let reference: Value = serde_json::from_str(&reference).unwrap();
    let case = &reference["prompts"][0];
    let dir = dir.to_str().expect("a UTF-8 path");
    let server = BinaryServer::spawn(&["--model", dir]);
    let c = client();
    let models: Value = c
        .get(server.url("/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "stories260k");
    // No `_name_or_path` in its config: `root` is the id.
    assert_eq!(models["data"][0]["root"], "stories260k");
    let n = case["generated_ids"].as_array().unwrap().len();
    for stream in [false, true] {
        let body =
            json!({"prompt": case["text"], "max_tokens": n, "temperature": 0, "stream": stream});
        let text = if stream {
            sse_chunks(&post_stream(&c, &server.url("/v1/completions"), &body).await)
                .iter()
                .map(|c| c["choices"][0]["text"].as_str().unwrap_or("").to_string())
                .collect::<String>()
        } else {
            let (status, v) = post_json(&c, &server.url("/v1/completions"), &body).await;
            assert_eq!(status, 200, "{v}");
            assert_eq!(
                v["usage"]["prompt_tokens"],
                case["prompt_ids"].as_array().unwrap().len()
            );
            v["choices"][0]["text"].as_str().unwrap().to_string()
        };
        assert_eq!(
            text,
            case["generated_text"].as_str().unwrap(),
            "stream={stream}"
        );
    }
}

/// `--mtp early-exit:L`: greedy output is the same with drafting on or off
/// (per request, `tandem.mtp`), the MTP counters move, and each response's
/// usage reports its own accepted and rejected drafts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_drafts_with_mtp_and_keeps_greedy_output() {
    let server = BinaryServer::spawn(&["--mtp", "early-exit:2", "--draft-max", "3"]);
    let c = client();
    let complete = |mtp: &'static str| {
        let c = c.clone();
        let url = server.url("/v1/completions");
        async move {
            let body = json!({"prompt": "hello there", "max_tokens": 24, "temperature": 0, "tandem": {"mtp": mtp}});
            let v: Value = c
                .post(url)
                .json(&body)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            v
        }
    };
    let (off, on) = (complete("off").await, complete("on").await);
    assert_eq!(on["choices"][0]["text"], off["choices"][0]["text"]);
    let details = |v: &Value, field: &str| {
        v["usage"]["completion_tokens_details"][field]
            .as_u64()
            .unwrap_or_else(|| panic!("{field} in {v}"))
    };
    assert_eq!(details(&off, "accepted_prediction_tokens"), 0);
    assert_eq!(details(&off, "rejected_prediction_tokens"), 0);
    assert!(details(&on, "accepted_prediction_tokens") > 0, "{on}");
    assert_eq!(
        details(&on, "rejected_prediction_tokens"),
        0,
        "a perfect draft"
    );
    let metrics = c
        .get(server.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let m = Metrics::parse(&metrics);
    assert!(m.get("tandem_mtp_drafted_tokens_total") > 0.0, "{metrics}");
    assert_eq!(
        m.get("tandem_mtp_accepted_tokens_total"),
        m.get("tandem_mtp_drafted_tokens_total"),
        "early-exit over every layer is a perfect draft"
    );
}
