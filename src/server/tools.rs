//! Tool calling on `/v1/chat/completions`: `tools`, `tool_choice`
//! (`none`, `auto`, `required`, a named function), `parallel_tool_calls`,
//! and tool messages (`role: tool` with `tool_call_id`, assistant
//! messages with `tool_calls`).
//!
//! # The one call format
//! Calls are Hermes / Qwen style, the format of templates that render
//! tools themselves: each call is
//! `<tool_call>\n{"name": "f", "arguments": {…}}\n</tool_call>`, calls
//! separated by a newline. [`parse_calls`] (whole answers) and
//! [`CallStream`] (streamed ones) turn that text into OpenAI `tool_calls`.
//!
//! # Two ways to tell the model
//! - **Templates that render tools** (their source mentions `tools`, as
//!   Hermes, Qwen 2.5 and Llama 3.1 templates do): the `tools` list goes
//!   into the template's context as Hugging Face passes it, and messages go
//!   in unchanged.
//! - **Templates that know nothing of tools** (SmolLM2's ChatML, the
//!   embedded model's plain format): the generic format, as llama.cpp's
//!   server does. The tool schemas and the call format go into the system
//!   prompt ([`ToolRequest::prepare_messages`]); earlier assistant calls
//!   are written back as call text and tool results are wrapped in
//!   `<tool_response>` tags.
//!
//! # What is enforced
//! `required` and a named function are a grammar (`tool_call_grammar`):
//! one or more calls (one when `parallel_tool_calls` is false), each
//! `name` one of the tools (or the named one) and its `arguments` valid
//! JSON for that function's `parameters` schema. `auto` under the generic
//! format is a grammar too: either calls or a plain answer (which may not
//! start with `<`); `auto` under a tool-aware template leaves the model
//! free and only parses. `none` describes nothing in the generic format
//! and parses nothing.

use serde_json::{json, Map, Value};

use super::body::Fields;
use super::chat_template::ChatMessage;
use super::errors::ApiError;
use super::params::check_tools;
use crate::structured::{Constraint, ConstraintOrigin, GrammarSpec};

pub const CALL_OPEN: &str = "<tool_call>";
pub const CALL_CLOSE: &str = "</tool_call>";

/// One function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSpec {
    pub name: String,
    pub description: String,
    /// JSON Schema of the arguments (`{"type": "object"}` when absent).
    pub parameters: Value,
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

/// A chat request's tools, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolRequest {
    pub tools: Vec<ToolSpec>,
    pub choice: ToolChoice,
    pub parallel: bool,
    /// `tools` as the client sent them (what tool-aware templates render).
    pub raw: Value,
}

/// Reads `tools`, `tool_choice` and `parallel_tool_calls`; `None` when no
/// tools were given (then `tool_choice` may only be `none` or `auto`).
pub fn parse_tools(f: &Fields) -> Result<Option<ToolRequest>, ApiError> {
    check_tools(f)?;
    let parallel = f.get::<bool>("parallel_tool_calls")?.unwrap_or(true);
    let Some(Value::Array(list)) = f.raw("tools") else {
        return Ok(None);
    };
    if list.is_empty() {
        return Ok(None);
    }
    let tools: Vec<ToolSpec> = list
        .iter()
        .map(|t| {
            let function = &t["function"];
            ToolSpec {
                name: function["name"].as_str().unwrap_or_default().to_string(),
                description: function["description"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                parameters: function
                    .get("parameters")
                    .cloned()
                    .unwrap_or_else(|| json!({"type": "object"})),
            }
        })
        .collect();
    let choice = match f.raw("tool_choice") {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            _ => ToolChoice::Required, // check_tools allowed only `required`
        },
        Some(Value::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::missing_field("tool_choice.function.name"))?;
            if !tools.iter().any(|t| t.name == name) {
                return Err(ApiError::invalid_field(
                    "tool_choice.function.name",
                    format!("`{name}` is not one of the `tools`"),
                ));
            }
            ToolChoice::Named(name.to_string())
        }
        // check_tools refuses every other shape; stay a 400 regardless.
        Some(other) => {
            return Err(ApiError::invalid_field(
                "tool_choice",
                format!("unexpected {}", super::body::describe(other)),
            ))
        }
    };
    Ok(Some(ToolRequest {
        tools,
        choice,
        parallel,
        raw: Value::Array(list.clone()),
    }))
}

impl ToolRequest {
    /// Whether the answer is parsed for calls.
    pub fn parses_calls(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// The generic format's tool prompt, joined to the system message (or
    /// a new one in front), for a template that knows nothing of tools.
    /// Nothing for `tool_choice: none`.
    pub fn add_tool_prompt(&self, messages: &mut Vec<ChatMessage>) {
        if self.choice == ToolChoice::None {
            return;
        }
        let prompt = self.system_prompt();
        match messages.first_mut() {
            Some(m) if m.role == "system" => {
                m.content = format!("{}\n\n{prompt}", m.content);
            }
            _ => messages.insert(0, ChatMessage::text("system", prompt)),
        }
    }

    fn system_prompt(&self) -> String {
        let mut out = String::from(
            "You can call functions. To call one, answer with only\n<tool_call>\n\
             {\"name\": \"<function name>\", \"arguments\": <arguments as a JSON object>}\n</tool_call>\n",
        );
        if self.parallel {
            out.push_str("(several calls: one block per call, one per line).\n");
        }
        out.push_str(match self.choice {
            ToolChoice::Auto => "If no function helps, answer the user directly.\n",
            _ => "You must call a function.\n",
        });
        out.push_str("Functions:\n");
        for t in &self.tools {
            out.push_str(&format!(
                "- {}: {} Arguments (JSON Schema): {}\n",
                t.name, t.description, t.parameters
            ));
        }
        out
    }

    /// The grammar the answer must follow, if any: `template_knows_tools`
    /// selects between the two ways of the module docs.
    pub fn constraint(&self, template_knows_tools: bool) -> Option<Constraint> {
        let grammar = match (&self.choice, template_knows_tools) {
            (ToolChoice::None, _) | (ToolChoice::Auto, true) => return None,
            (ToolChoice::Auto, false) => tool_call_grammar(&self.tools, self.parallel, true),
            (ToolChoice::Required, _) => tool_call_grammar(&self.tools, self.parallel, false),
            (ToolChoice::Named(name), _) => {
                let one: Vec<ToolSpec> = self
                    .tools
                    .iter()
                    .filter(|t| &t.name == name)
                    .cloned()
                    .collect();
                tool_call_grammar(&one, false, false)
            }
        };
        Some(Constraint::new(
            GrammarSpec::Lark { grammar },
            ConstraintOrigin::Tools,
        ))
    }
}

/// Lark: calls to `tools` (with `%json` arguments), optionally or a plain
/// answer that does not start with `<`.
fn tool_call_grammar(tools: &[ToolSpec], parallel: bool, or_text: bool) -> String {
    let calls = if parallel {
        "calls: call (\"\\n\" call)*"
    } else {
        "calls: call"
    };
    let start = if or_text {
        "start: calls | TEXT\nTEXT: /[^<][\\s\\S]*/"
    } else {
        "start: calls"
    };
    let alternatives: Vec<String> = (0..tools.len()).map(|i| format!("f{i}")).collect();
    let mut g = format!(
        "{start}\n{calls}\ncall: \"{CALL_OPEN}\\n\" body \"\\n{CALL_CLOSE}\"\nbody: {}\n",
        alternatives.join(" | ")
    );
    for (i, t) in tools.iter().enumerate() {
        let schema = json!({
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": t.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": false,
            "x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "},
        });
        g.push_str(&format!("f{i}: %json {schema}\n"));
    }
    g
}

/// The generic format's rewrite of a conversation for a template that
/// knows nothing of tools: every assistant message's `tool_calls` become
/// call text, every tool message's content goes in `<tool_response>` tags.
pub fn write_back_all(messages: &mut [ChatMessage]) {
    messages.iter_mut().for_each(write_back_calls);
}

fn write_back_calls(m: &mut ChatMessage) {
    if let Some(Value::Array(calls)) = m.tool_calls.take() {
        for call in calls {
            let f = &call["function"];
            let args = match &f["arguments"] {
                Value::String(s) => serde_json::from_str(s).unwrap_or(Value::String(s.clone())),
                other => other.clone(),
            };
            let body = json!({"name": f["name"], "arguments": args});
            if !m.content.is_empty() {
                m.content.push('\n');
            }
            m.content
                .push_str(&format!("{CALL_OPEN}\n{body}\n{CALL_CLOSE}"));
        }
    }
    if m.role == "tool" {
        m.content = format!("<tool_response>\n{}\n</tool_response>", m.content);
    }
}

/// One parsed call, as OpenAI shapes it.
fn call_json(index: usize, id: String, name: &str, arguments: String) -> Value {
    json!({
        "index": index,
        "id": id,
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    })
}

/// The `(name, arguments as a JSON string)` of a call block's body.
fn parse_call_body(body: &str) -> Option<(String, String)> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let args = match v.get("arguments") {
        Some(Value::String(s)) => s.clone(),
        Some(a) => a.to_string(),
        None => "{}".into(),
    };
    Some((name, args))
}

/// A whole answer split into its text and its calls: the streamed
/// splitter run over the whole text, its deltas joined per call, so both
/// forms of a response carry the same arguments text. Call ids are
/// `call_{request}_{n}`. Text outside the blocks (trimmed) is the content;
/// a block that does not parse stays in the content.
pub fn parse_calls(text: &str, id_prefix: &str) -> (Option<String>, Vec<Value>) {
    let mut stream = CallStream::new(id_prefix.to_string());
    let (mut content, deltas) = stream.push(text);
    content.push_str(&stream.finish());
    let mut calls: Vec<Value> = Vec::new();
    for delta in deltas {
        match calls.iter_mut().find(|c| c["index"] == delta["index"]) {
            Some(call) => append_arguments(call, &delta["function"]["arguments"]),
            None => calls.push(delta),
        }
    }
    let content = content.trim();
    let content = (!content.is_empty() || calls.is_empty()).then(|| content.to_string());
    (content, calls)
}

/// Adds a fragment's arguments text to a call's (or an earlier delta's).
fn append_arguments(call: &mut Value, fragment: &Value) {
    let fragment = fragment.as_str().unwrap_or_default();
    if let Some(Value::String(args)) = call.pointer_mut("/function/arguments") {
        args.push_str(fragment);
    }
}

/// Splits a streamed answer into content deltas and `tool_calls` deltas
/// shaped like OpenAI's. Text that could still be the start of a call
/// block is held back until it is known. A block whose body starts
/// `{"name": "…", "arguments": {` (the order the generic format's grammar
/// enforces) streams: one delta with the call's index, id, type, name and
/// empty arguments as soon as the name is complete, then the arguments
/// object's text as it arrives, up to the brace that closes it. Any other
/// body is parsed whole at `</tool_call>` and becomes one complete delta
/// (or content, when it is not a call).
#[derive(Debug, Default)]
pub struct CallStream {
    /// Text not yet sent: after an open tag, the block's body so far.
    pending: String,
    /// The block being read, when an open tag has been seen.
    open: Option<OpenCall>,
    calls: usize,
    id_prefix: String,
}

/// The call block being read.
#[derive(Debug)]
struct OpenCall {
    index: usize,
    /// Where the arguments object starts in the body, once the header has
    /// been read and sent.
    args_start: Option<usize>,
    /// The body does not start like a streamable call: parse it whole.
    whole: bool,
    /// The body's bytes sent as arguments so far (from `args_start`).
    sent_to: usize,
    scan: JsonDepth,
}

/// Where a scan of JSON text stands: nesting depth, inside a string, after
/// a backslash. Depth 0 after the first byte means the value is closed.
#[derive(Debug, Default)]
struct JsonDepth {
    depth: usize,
    in_string: bool,
    escaped: bool,
    closed: bool,
}

impl JsonDepth {
    /// Feeds one byte; structural characters are ASCII, so bytes suffice.
    fn feed(&mut self, b: u8) {
        if self.in_string {
            match (self.escaped, b) {
                (true, _) => self.escaped = false,
                (false, b'\\') => self.escaped = true,
                (false, b'"') => self.in_string = false,
                _ => {}
            }
            return;
        }
        match b {
            b'"' => self.in_string = true,
            b'{' | b'[' => self.depth += 1,
            b'}' | b']' => {
                self.depth = self.depth.saturating_sub(1);
                self.closed = self.depth == 0;
            }
            _ => {}
        }
    }
}

impl OpenCall {
    fn new(index: usize) -> Self {
        Self {
            index,
            args_start: None,
            whole: false,
            sent_to: 0,
            scan: JsonDepth::default(),
        }
    }

    /// Reads the body so far: sends the header once it is known, then the
    /// arguments text that arrived since the last call.
    fn advance(&mut self, body: &str, id_prefix: &str, deltas: &mut Vec<Value>) {
        if self.whole || self.scan.closed {
            return;
        }
        if self.args_start.is_none() {
            match read_header(body) {
                Header::Partial => return,
                Header::Other => {
                    self.whole = true;
                    return;
                }
                Header::Streamable { name, args_start } => {
                    self.args_start = Some(args_start);
                    self.sent_to = args_start;
                    let id = format!("{id_prefix}_{}", self.index);
                    deltas.push(call_json(self.index, id, &name, String::new()));
                }
            }
        }
        let from = self.sent_to;
        let mut to = body.len();
        for (i, b) in body.bytes().enumerate().skip(from) {
            self.scan.feed(b);
            if self.scan.closed {
                to = i + 1;
                break;
            }
        }
        if to > from {
            push_arguments(deltas, self.index, &body[from..to]);
            self.sent_to = to;
        }
    }

    fn streamed(&self) -> bool {
        self.args_start.is_some()
    }
}

/// Appends an arguments fragment to this push's delta for the call, or
/// starts one.
fn push_arguments(deltas: &mut Vec<Value>, index: usize, text: &str) {
    match deltas.last_mut() {
        Some(last) if last["index"] == index => append_arguments(last, &json!(text)),
        _ => deltas.push(json!({"index": index, "function": {"arguments": text}})),
    }
}

/// What the start of a call block's body says so far.
enum Header {
    /// Not enough text yet.
    Partial,
    /// `{"name": "…", "arguments": {`: the arguments object starts at
    /// `args_start`.
    Streamable { name: String, args_start: usize },
    /// Some other shape.
    Other,
}

fn read_header(body: &str) -> Header {
    use Header::{Other, Partial};
    let mut c = Cursor { s: body, at: 0 };
    macro_rules! step {
        ($e:expr) => {
            match $e {
                Step::More => return Partial,
                Step::No => return Other,
                Step::Yes(v) => v,
            }
        };
    }
    step!(c.literal("{"));
    if step!(c.string()) != "name" {
        return Other;
    }
    step!(c.literal(":"));
    let name = step!(c.string());
    step!(c.literal(","));
    if step!(c.string()) != "arguments" {
        return Other;
    }
    step!(c.literal(":"));
    c.skip_whitespace();
    match body[c.at..].bytes().next() {
        None => Partial,
        Some(b'{') => Header::Streamable {
            name,
            args_start: c.at,
        },
        Some(_) => Other,
    }
}

enum Step<T> {
    More,
    No,
    Yes(T),
}

/// A position in incomplete JSON text.
struct Cursor<'a> {
    s: &'a str,
    at: usize,
}

impl Cursor<'_> {
    fn skip_whitespace(&mut self) {
        let rest = &self.s[self.at..];
        self.at += rest.len() - rest.trim_start().len();
    }

    fn literal(&mut self, lit: &str) -> Step<()> {
        self.skip_whitespace();
        let rest = &self.s[self.at..];
        if rest.starts_with(lit) {
            self.at += lit.len();
            Step::Yes(())
        } else if lit.starts_with(rest) {
            Step::More
        } else {
            Step::No
        }
    }

    /// A whole JSON string, unescaped.
    fn string(&mut self) -> Step<String> {
        self.skip_whitespace();
        let rest = &self.s[self.at..];
        match rest.bytes().next() {
            None => return Step::More,
            Some(b'"') => {}
            Some(_) => return Step::No,
        }
        let mut escaped = false;
        for (i, b) in rest.bytes().enumerate().skip(1) {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => {
                    return match serde_json::from_str(&rest[..=i]) {
                        Ok(s) => {
                            self.at += i + 1;
                            Step::Yes(s)
                        }
                        Err(_) => Step::No,
                    };
                }
                _ => {}
            }
        }
        Step::More
    }
}

impl CallStream {
    pub fn new(id_prefix: String) -> Self {
        Self {
            id_prefix,
            ..Self::default()
        }
    }

    /// Whether any call was completed (the finish reason is then
    /// `tool_calls`).
    pub fn called(&self) -> bool {
        self.calls > 0
    }

    /// New text in; the content to send now and the `tool_calls` deltas.
    pub fn push(&mut self, text: &str) -> (String, Vec<Value>) {
        self.pending.push_str(text);
        let mut content = String::new();
        let mut deltas = Vec::new();
        loop {
            let Some(mut call) = self.open.take() else {
                let Some(open) = self.pending.find(CALL_OPEN) else {
                    // No block start: keep only a tail that may begin one.
                    let keep = partial_open_len(&self.pending);
                    let send = self.pending.len() - keep;
                    content.push_str(&self.pending[..send]);
                    self.pending.drain(..send);
                    break;
                };
                content.push_str(&self.pending[..open]);
                self.pending.drain(..open + CALL_OPEN.len());
                self.open = Some(OpenCall::new(self.calls));
                continue;
            };
            let close = self.pending.find(CALL_CLOSE);
            let body = &self.pending[..close.unwrap_or(self.pending.len())];
            call.advance(body, &self.id_prefix, &mut deltas);
            let Some(close) = close else {
                self.open = Some(call);
                break;
            };
            if call.streamed() {
                self.calls += 1;
            } else if let Some((name, args)) = parse_call_body(body) {
                let n = self.calls;
                self.calls += 1;
                deltas.push(call_json(n, format!("{}_{n}", self.id_prefix), &name, args));
            } else {
                content.push_str(&format!("{CALL_OPEN}{body}{CALL_CLOSE}"));
            }
            self.pending.drain(..close + CALL_CLOSE.len());
        }
        if self.calls > 0 {
            // Whitespace between calls is not content.
            content = content.trim().to_string();
        }
        (content, deltas)
    }

    /// The end of the answer: whatever is held back is content (a block
    /// cut short whose arguments were streamed has nothing left to send).
    pub fn finish(&mut self) -> String {
        let rest = std::mem::take(&mut self.pending);
        match self.open.take() {
            Some(call) if call.streamed() => String::new(),
            Some(_) => format!("{CALL_OPEN}{rest}"),
            None => rest,
        }
    }
}

/// The length of the longest suffix of `s` that is a proper prefix of
/// [`CALL_OPEN`].
fn partial_open_len(s: &str) -> usize {
    (1..CALL_OPEN.len())
        .rev()
        .find(|&n| {
            s.len() >= n
                && s.is_char_boundary(s.len() - n)
                && CALL_OPEN.starts_with(&s[s.len() - n..])
        })
        .unwrap_or(0)
}

/// The tool fields of message `i` (`tool_calls` of an assistant message,
/// `tool_call_id` of a tool message), type-checked.
pub fn message_tool_fields(
    m: &Map<String, Value>,
    i: usize,
) -> Result<(Option<Value>, Option<String>), ApiError> {
    let calls = match m.get("tool_calls") {
        None | Some(Value::Null) => None,
        Some(v @ Value::Array(calls)) => {
            for (j, c) in calls.iter().enumerate() {
                let name = c.get("function").and_then(|f| f.get("name"));
                if !name.is_some_and(Value::is_string) {
                    return Err(ApiError::invalid_field(
                        format!("messages[{i}].tool_calls[{j}].function.name"),
                        "expected a string",
                    ));
                }
            }
            Some(v.clone())
        }
        Some(_) => {
            return Err(ApiError::invalid_field(
                format!("messages[{i}].tool_calls"),
                "expected a list of tool calls",
            ))
        }
    };
    let id = match m.get("tool_call_id") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => {
            return Err(ApiError::invalid_field(
                format!("messages[{i}].tool_call_id"),
                "expected a string",
            ))
        }
    };
    Ok((calls, id))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::body::parse_object;

    fn request(json: &str) -> Result<Option<ToolRequest>, ApiError> {
        parse_tools(&parse_object(json.as_bytes()).unwrap())
    }

    const TOOLS: &str = r#""tools":[{"type":"function","function":{"name":"get_weather","description":"Weather of a city.","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}}]"#;

    #[test]
    fn choices_parse_and_bad_ones_are_named() {
        let r = request(&format!("{{{TOOLS}}}")).unwrap().unwrap();
        assert_eq!((r.choice.clone(), r.parallel), (ToolChoice::Auto, true));
        let r = request(&format!(
            r#"{{{TOOLS},"tool_choice":"required","parallel_tool_calls":false}}"#
        ))
        .unwrap()
        .unwrap();
        assert_eq!((r.choice, r.parallel), (ToolChoice::Required, false));
        let r = request(&format!(
            r#"{{{TOOLS},"tool_choice":{{"type":"function","function":{{"name":"get_weather"}}}}}}"#
        ))
        .unwrap()
        .unwrap();
        assert_eq!(r.choice, ToolChoice::Named("get_weather".into()));
        let param = |json: String| request(&json).unwrap_err().param.unwrap_or_default();
        assert_eq!(
            param(format!(
                r#"{{{TOOLS},"tool_choice":{{"type":"function","function":{{"name":"nope"}}}}}}"#
            )),
            "tool_choice.function.name"
        );
        assert_eq!(
            param(format!(r#"{{{TOOLS},"tool_choice":"maybe"}}"#)),
            "tool_choice"
        );
        assert_eq!(param(r#"{"tool_choice":"required"}"#.into()), "tool_choice");
        assert_eq!(
            param(format!(r#"{{{TOOLS},"parallel_tool_calls":"yes"}}"#)),
            "parallel_tool_calls"
        );
        assert!(request(r#"{"tools":[]}"#).unwrap().is_none());
    }

    #[test]
    fn whole_answers_split_into_content_and_calls() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>";
        let (content, calls) = parse_calls(text, "call_1");
        assert_eq!(content.as_deref(), Some("Let me check."));
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        assert_eq!(calls[0]["id"], "call_1_0");
        let args: Value =
            serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(args, json!({"city": "Paris"}));
        let (content, calls) = parse_calls("just text", "c");
        assert_eq!((content.as_deref(), calls.len()), (Some("just text"), 0));
        let (content, calls) = parse_calls("<tool_call>\nnot json\n</tool_call>", "c");
        assert_eq!(calls.len(), 0);
        assert!(content.unwrap().contains("not json"));
    }

    /// Streams `text` in pieces of `size` characters: the content and the
    /// deltas in order.
    fn stream_in_pieces(text: &str, size: usize) -> (String, Vec<Value>) {
        let mut s = CallStream::new("c".into());
        let (mut content, mut deltas) = (String::new(), Vec::new());
        let chars: Vec<char> = text.chars().collect();
        for piece in chars.chunks(size) {
            let (c, d) = s.push(&piece.iter().collect::<String>());
            content.push_str(&c);
            deltas.extend(d);
        }
        content.push_str(&s.finish());
        (content, deltas)
    }

    /// Joins deltas per index, as OpenAI's clients do: (id, name, arguments).
    fn reassemble(deltas: &[Value]) -> Vec<(String, String, String)> {
        let mut calls: Vec<(String, String, String)> = Vec::new();
        for d in deltas {
            let i = d["index"].as_u64().unwrap() as usize;
            if i == calls.len() {
                assert_eq!(d["type"], "function", "a call's first delta: {d}");
                calls.push(Default::default());
            }
            let call = &mut calls[i];
            if let Some(id) = d["id"].as_str() {
                call.0 = id.to_string();
            }
            if let Some(name) = d["function"]["name"].as_str() {
                call.1.push_str(name);
            }
            call.2
                .push_str(d["function"]["arguments"].as_str().unwrap());
        }
        calls
    }

    #[test]
    fn streamed_answers_split_at_any_chunking() {
        let text = "Hi <b> <tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": [1, \"}\\\"é\"], \"y\": {}}}\n</tool_call>\n<tool_call>\n{\"name\": \"g\", \"arguments\": {}}\n</tool_call>";
        let (whole_content, whole) = parse_calls(text, "c");
        assert_eq!(whole_content.as_deref(), Some("Hi <b>"));
        for size in 1..text.chars().count() {
            let (content, deltas) = stream_in_pieces(text, size);
            let calls = reassemble(&deltas);
            assert_eq!(
                calls,
                vec![
                    (
                        "c_0".into(),
                        "f".into(),
                        "{\"x\": [1, \"}\\\"é\"], \"y\": {}}".into()
                    ),
                    ("c_1".into(), "g".into(), "{}".into()),
                ],
                "size {size}"
            );
            assert_eq!(content.trim(), "Hi <b>", "size {size}");
            for (call, (id, name, args)) in whole.iter().zip(&calls) {
                assert_eq!(call["id"], id.as_str());
                assert_eq!(call["function"]["name"], name.as_str());
                assert_eq!(call["function"]["arguments"], args.as_str());
            }
        }
        // Character by character the arguments arrive in many deltas.
        let (_, deltas) = stream_in_pieces(text, 1);
        assert!(deltas.len() > 10, "{deltas:?}");
    }

    /// Bodies of another shape (arguments first, arguments as a string)
    /// are parsed whole at the close; a block cut short whose arguments
    /// were streamed leaves no content behind; one that was not streamed
    /// comes back as content.
    #[test]
    fn other_call_shapes_and_cut_blocks() {
        for body in [
            "{\"arguments\": {\"a\": 1}, \"name\": \"f\"}",
            "{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}",
        ] {
            let text = format!("<tool_call>\n{body}\n</tool_call>");
            for size in [1, 3, 1000] {
                let (content, deltas) = stream_in_pieces(&text, size);
                assert_eq!(deltas.len(), 1, "{body}, size {size}: {deltas:?}");
                assert_eq!(deltas[0]["function"]["name"], "f");
                let args: Value =
                    serde_json::from_str(deltas[0]["function"]["arguments"].as_str().unwrap())
                        .unwrap();
                assert_eq!(args, json!({"a": 1}));
                assert!(content.trim().is_empty(), "{content:?}");
            }
        }
        let mut s = CallStream::new("c".into());
        let (_, deltas) = s.push("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": ");
        assert_eq!(reassemble(&deltas)[0].2, "{\"a\": ");
        assert_eq!(s.finish(), "");
        assert!(!s.called());
        let mut s = CallStream::new("c".into());
        assert!(s.push("<tool_call>\n{\"nam").1.is_empty());
        assert_eq!(s.finish(), "<tool_call>\n{\"nam");
    }

    #[test]
    fn grammars_compile_and_the_generic_prompt_names_the_tools() {
        let r = request(&format!(r#"{{{TOOLS},"tool_choice":"required"}}"#))
            .unwrap()
            .unwrap();
        let tok = crate::tokenizer::word_level_tokenizer(2000, 7).unwrap();
        let compiler = tok.grammar_compiler().unwrap();
        for knows in [false, true] {
            let c = r.constraint(knows).unwrap();
            compiler.compile(&c.spec).unwrap();
        }
        let auto = request(&format!("{{{TOOLS}}}")).unwrap().unwrap();
        assert!(auto.constraint(true).is_none());
        compiler
            .compile(&auto.constraint(false).unwrap().spec)
            .unwrap();
        let mut messages = vec![
            ChatMessage::text("user", "weather?".into()),
            ChatMessage {
                role: "assistant".into(),
                tool_calls: Some(json!([{"id": "c", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}])),
                ..ChatMessage::default()
            },
            ChatMessage {
                tool_call_id: Some("c".into()),
                ..ChatMessage::text("tool", "sunny".into())
            },
        ];
        write_back_all(&mut messages);
        auto.add_tool_prompt(&mut messages);
        assert_eq!(messages[0].role, "system");
        assert!(messages[0].content.contains("get_weather"));
        assert_eq!(
            messages[2].content,
            "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}\n</tool_call>"
        );
        assert_eq!(
            messages[3].content,
            "<tool_response>\nsunny\n</tool_response>"
        );
    }

    /// A Hermes-style template (one that renders `tools`) sees the tools
    /// and the messages' calls itself.
    #[test]
    fn a_tool_aware_template_renders_the_tools() {
        use crate::server::ChatTemplate;
        let src = "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}\
            {% for m in messages %}[{{ m.role }}]{{ m.content }}{% if m.tool_calls %}{% for c in m.tool_calls %}<call {{ c.function.name }}>{% endfor %}{% endif %}{% endfor %}";
        let t = ChatTemplate::new(Some(src), String::new(), String::new()).unwrap();
        assert!(t.knows_tools());
        let r = request(&format!("{{{TOOLS}}}")).unwrap().unwrap();
        let messages = vec![
            ChatMessage::text("user", "hi".into()),
            ChatMessage {
                role: "assistant".into(),
                tool_calls: Some(json!([{"function": {"name": "get_weather", "arguments": "{}"}}])),
                ..ChatMessage::default()
            },
        ];
        let p = t.render_with_tools(&messages, false, Some(&r.raw)).unwrap();
        assert_eq!(
            p,
            "<tools>get_weather;</tools>[user]hi[assistant]<call get_weather>"
        );
        let plain = ChatTemplate::new(
            Some("{% for m in messages %}{{ m.content }}{% endfor %}"),
            String::new(),
            String::new(),
        )
        .unwrap();
        assert!(!plain.knows_tools());
    }
}
