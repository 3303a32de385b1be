//! Property tests of the request parsers: bodies with random JSON values in
//! every field the routes read. Whatever comes in, parsing never panics, an
//! error is never a 5xx, and it names a field the body actually holds (or
//! the missing required one), in its message too.

use proptest::prelude::*;
use serde_json::{json, Map, Value};

use super::body::Fields;
use super::errors::ApiError;
use super::{routes_chat, routes_completions};

/// Every field either route reads, plus unknown ones (ignored).
const FIELDS: &[&str] = &[
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "top_k",
    "min_p",
    "repetition_penalty",
    "repeat_last_n",
    "stop",
    "stream",
    "stream_options",
    "n",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "echo",
    "suffix",
    "best_of",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "stop_token_ids",
    "response_format",
    "add_generation_prompt",
    "tandem",
    "user",
    "metadata",
];

/// Any JSON value, nested a little, with the edge numbers that break
/// parsers (huge, negative, fractional) over-represented.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|x| json!(x)),
        any::<u64>().prop_map(|x| json!(x)),
        (-1e6f64..1e6).prop_map(|x| json!(x)),
        prop_oneof![
            Just(-1.0),
            Just(0.0),
            Just(0.5),
            Just(1.0),
            Just(2.0),
            Just(101.0),
            Just(1e300)
        ]
        .prop_map(|x: f64| json!(x)),
        "[a-z0-9 ]{0,8}".prop_map(Value::String),
        prop_oneof![
            Just("on"),
            Just("off"),
            Just("function"),
            Just("text"),
            Just("user"),
            Just("5")
        ]
        .prop_map(|s| json!(s)),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::vec(
                (
                    prop_oneof![
                        "[a-z_]{1,6}",
                        prop::sample::select(vec![
                            "role",
                            "content",
                            "type",
                            "text",
                            "function",
                            "name",
                            "mtp",
                            "draft_max",
                            "include_usage",
                            "5",
                            "parameters",
                        ])
                        .prop_map(str::to_string),
                    ],
                    inner
                ),
                0..4
            )
            .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// A body: some of the known fields, each with a random value.
fn any_body() -> impl Strategy<Value = Map<String, Value>> {
    prop::collection::vec((prop::sample::select(FIELDS), any_json()), 0..8)
        .prop_map(|kv| kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
}

/// The error's field, checked against the body.
fn check_error(e: &ApiError, body: &Map<String, Value>, required: &str) {
    assert!(
        e.status.is_client_error(),
        "a 4xx, got {} for {body:?}",
        e.status
    );
    let param = e
        .param
        .as_deref()
        .unwrap_or_else(|| panic!("no field named: {e:?} for {body:?}"));
    let root = param.split(['[', '.']).next().unwrap_or(param);
    assert!(
        body.contains_key(root) || root == required,
        "`{param}` is not in {body:?}"
    );
    assert!(e.message.contains(root), "{e:?}");
    serde_json::from_str::<Value>(&e.body_json()).expect("a JSON error body");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn completions_bodies_parse_or_name_their_field(body in any_body()) {
        let f = Fields::from_map(body.clone());
        if let Err(e) = routes_completions::parse(&f) {
            check_error(&e, &body, "prompt");
        }
    }

    #[test]
    fn chat_bodies_parse_or_name_their_field(body in any_body()) {
        let f = Fields::from_map(body.clone());
        if let Err(e) = routes_chat::parse(&f) {
            check_error(&e, &body, "messages");
        }
    }

    /// Valid bodies with one field replaced by a random value.
    #[test]
    fn one_wrong_field_in_a_good_body_is_named(field in prop::sample::select(FIELDS), value in any_json()) {
        let mut body = json!({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 4, "temperature": 0.5})
            .as_object()
            .cloned()
            .unwrap_or_default();
        body.insert(field.to_string(), value);
        let f = Fields::from_map(body.clone());
        if let Err(e) = routes_completions::parse(&f) {
            check_error(&e, &body, "prompt");
        }
        if let Err(e) = routes_chat::parse(&f) {
            check_error(&e, &body, "messages");
        }
    }
}
