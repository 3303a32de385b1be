//! Prompts the target answers to make its own training data.
//!
//! A chat model's drafts matter on chat answers, so the head is trained on
//! the target's answers to chat prompts, rendered through the model's own
//! chat template (the server's renderer, [`crate::server::ChatTemplate`]).
//! The prompts are either a file (one per line) or a built-in set made
//! combinatorially from request templates × topics: questions,
//! explanations, instructions, code requests, lists, summaries, rewrites.
//! The built-in set is deterministic (its order is a fixed ChaCha8 shuffle
//! of raw `u64` draws, not a version-dependent sampling routine).
//!
//! A chat model can also write requests itself ([`self_prompts`], the
//! Magpie recipe): continued from its chat template's text up to a user
//! message, it writes the kind of requests its own chat data held. The
//! built-in set is a few dozen request templates, so a head trained on it
//! alone learns their phrasings and drafts worse on other requests than
//! its held-out figure (the held-out prompts share the templates) says.
//!
//! Models without a tokenizer worth speaking to (the embedded random-weight
//! models of the tests) use [`random_token_prompts`] instead: a few random
//! ids after BOS.

use std::path::Path;

use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::TrainError;
use crate::model::ModelConfig;

/// Seed of the built-in set's order.
const BUILTIN_SEED: u64 = 0x5eed_c4a7;

/// Topics the general templates are filled with.
const TOPICS: &[&str] = &[
    "photosynthesis",
    "the water cycle",
    "black holes",
    "the French Revolution",
    "machine learning",
    "climate change",
    "the human heart",
    "volcanoes",
    "the stock market",
    "honey bees",
    "the Roman Empire",
    "electric cars",
    "sleep",
    "the moon",
    "vaccines",
    "coffee",
    "the internet",
    "earthquakes",
    "renewable energy",
    "the immune system",
    "ancient Egypt",
    "dinosaurs",
    "the printing press",
    "recycling",
    "the ocean",
    "gravity",
    "bread baking",
    "meditation",
    "the solar system",
    "rainforests",
    "inflation",
    "the Olympic Games",
    "chess",
    "DNA",
    "friendship",
    "public speaking",
    "time management",
    "healthy eating",
    "learning a new language",
    "the Great Wall of China",
    "artificial intelligence",
    "bicycles",
    "the piano",
    "democracy",
    "pollution",
    "the desert",
    "social media",
    "exercise",
    "the brain",
    "electricity",
    "penguins",
    "the Industrial Revolution",
    "gardening",
    "tea",
    "the weather",
    "space exploration",
    "mountains",
    "music",
    "rivers",
    "the printing of money",
    "cats",
    "dogs",
    "photography",
    "the history of writing",
    "trains",
    "airplanes",
    "antibiotics",
    "the seasons",
    "oceans and tides",
    "saving money",
    "cooking pasta",
    "the alphabet",
    "stars",
    "the rain",
    "libraries",
    "football",
    "birds migrating",
    "bridges",
    "the desert fox",
    "kindness",
];

/// Requests about a topic (`{}` is the topic).
const TEMPLATES: &[&str] = &[
    "What is {}?",
    "Explain {} in simple terms.",
    "Why is {} important?",
    "Tell me three interesting facts about {}.",
    "Write a short poem about {}.",
    "List five things everyone should know about {}.",
    "How would you explain {} to a ten-year-old?",
    "Write a short paragraph about {}.",
    "What are the pros and cons of {}?",
    "Give me a quick summary of {}.",
    "Write a short story that involves {}.",
    "What is the history of {}?",
    "Describe {} in one paragraph.",
    "What are common misconceptions about {}?",
    "Give me a list of questions to ask about {}.",
    "Write a haiku about {}.",
    "How does {} affect our daily lives?",
    "Write an introduction for an essay about {}.",
    "What would happen if there were no {}?",
    "Give me some tips for teaching {}.",
    "Compare {} with something similar.",
    "Write a tweet about {}.",
    "What are the main parts of {}?",
    "Summarize what scientists know about {}.",
    "Write a short dialogue between two friends about {}.",
    "Can you give me an outline for a talk on {}?",
];

/// Programming tasks (combined with [`LANGUAGES`]).
const CODE_TASKS: &[&str] = &[
    "reverses a string",
    "checks whether a number is prime",
    "computes the factorial of a number",
    "returns the largest element of a list",
    "counts the vowels in a string",
    "sorts a list of numbers",
    "computes the Fibonacci numbers up to n",
    "removes duplicates from a list",
    "checks whether a word is a palindrome",
    "converts Celsius to Fahrenheit",
    "sums the even numbers in a list",
    "reads a file and counts its lines",
    "finds the average of a list of numbers",
    "merges two sorted lists",
    "counts how often each word appears in a text",
    "checks whether two strings are anagrams",
];

const LANGUAGES: &[&str] = &["Python", "JavaScript", "Rust", "C", "Java"];

/// Code-request templates: the language, then the task.
const CODE_TEMPLATES: &[&str] = &[
    "Write a {} function that {}.",
    "Show me {} code that {}.",
    "How do I write a {} program that {}?",
];

/// Sentences of the passages the summary and rewrite requests carry.
const PASSAGE_SENTENCES: &[&str] = &[
    "{} has been studied for many years by researchers around the world.",
    "Many people find {} fascinating because it touches everyday life.",
    "Experts say that understanding {} helps us make better decisions.",
    "The basic ideas behind {} are simpler than they first appear.",
    "Schools often teach {} to students at an early age.",
];

/// Requests that carry a passage (`{}` is the passage).
const PASSAGE_TEMPLATES: &[&str] = &[
    "Summarize the following text in one sentence: {}",
    "Rewrite this text to make it more formal: {}",
    "Give this paragraph a title: {}",
    "Turn this text into three bullet points: {}",
];

fn fill(template: &str, args: &[&str]) -> String {
    let mut out = String::with_capacity(template.len() + 32);
    let mut parts = template.split("{}");
    out.push_str(parts.next().unwrap_or(""));
    for (part, arg) in parts.zip(args.iter().cycle()) {
        out.push_str(arg);
        out.push_str(part);
    }
    out
}

/// Every built-in prompt, in a fixed shuffled order (a few thousand).
pub fn builtin_all() -> Vec<String> {
    let mut all = Vec::new();
    for t in TEMPLATES {
        for topic in TOPICS {
            all.push(fill(t, &[topic]));
        }
    }
    for t in CODE_TEMPLATES {
        for lang in LANGUAGES {
            for task in CODE_TASKS {
                all.push(fill(t, &[lang, task]));
            }
        }
    }
    for (i, topic) in TOPICS.iter().enumerate() {
        let a = PASSAGE_SENTENCES[i % PASSAGE_SENTENCES.len()];
        let b = PASSAGE_SENTENCES[(i + 2) % PASSAGE_SENTENCES.len()];
        let passage = format!("{} {}", fill(a, &[topic]), fill(b, &[topic]));
        for t in PASSAGE_TEMPLATES {
            all.push(fill(t, &[&passage]));
        }
    }
    shuffle(&mut all, BUILTIN_SEED);
    all
}

/// The first `n` built-in prompts (repeating the set when `n` exceeds it;
/// sampled continuations still differ).
pub fn builtin(n: usize) -> Vec<String> {
    let all = builtin_all();
    (0..n).map(|i| all[i % all.len()].clone()).collect()
}

/// `items` in an order fixed by `seed` (the prompt sources mixed, so the
/// first `--train-seqs` of them draw from each).
pub fn shuffled<T>(mut items: Vec<T>, seed: u64) -> Vec<T> {
    shuffle(&mut items, seed);
    items
}

/// Fisher–Yates over raw ChaCha8 draws (stable across `rand` versions).
fn shuffle<T>(items: &mut [T], seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    for i in (1..items.len()).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        items.swap(i, j);
    }
}

/// One prompt per non-blank line of `path` (`\n` inside a line stands for
/// a newline).
pub fn read_file(path: &Path) -> Result<Vec<String>, TrainError> {
    let text = std::fs::read_to_string(path).map_err(|e| TrainError::Io {
        path: path.into(),
        reason: e.to_string(),
    })?;
    let prompts: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(|l| l.replace("\\n", "\n"))
        .collect();
    if prompts.is_empty() {
        return Err(TrainError::Io {
            path: path.into(),
            reason: "no prompts (expected one per line)".into(),
        });
    }
    Ok(prompts)
}

/// Each prompt as a one-message user turn, rendered through the
/// tokenizer's chat template with the assistant's cue, and encoded as the
/// server encodes a chat request.
#[cfg(feature = "server")]
pub fn render_chat(
    tokenizer: &crate::tokenizer::Tokenizer,
    prompts: &[String],
) -> Result<Vec<Vec<u32>>, TrainError> {
    use crate::server::{ChatMessage, ChatTemplate};
    let template =
        ChatTemplate::from_tokenizer(tokenizer).map_err(|e| TrainError::Prompt(format!("{e}")))?;
    prompts
        .iter()
        .map(|p| {
            let text = template
                .render(&[ChatMessage::text("user", p.clone())], true)
                .map_err(|e| TrainError::Prompt(format!("rendering {p:?}: {e:?}")))?;
            tokenizer
                .encode(&text)
                .map_err(|e| TrainError::Prompt(format!("encoding {p:?}: {e}")))
        })
        .collect()
}

/// Longest request [`self_prompts`] lets the target write, in tokens.
pub const SELF_PROMPT_TOKENS: usize = 96;

/// Requests a round of [`self_prompts`] asks the target for at most.
const SELF_PROMPT_ROUND: usize = 256;

/// `n` distinct user requests the target writes itself: the chat template
/// rendered up to a user message's content, continued at temperature 1
/// until the target closes the turn (an EOS, or the text the template puts
/// after a message's content). A request that is not closed within
/// [`SELF_PROMPT_TOKENS`], is blank, or repeats a kept one is dropped;
/// rounds go on until `n` are kept, and fail after `4n` tries. The result
/// depends only on the target and `seed`.
#[cfg(feature = "server")]
pub fn self_prompts(
    target: &crate::model::Model,
    tokenizer: &crate::tokenizer::Tokenizer,
    n: usize,
    seed: u64,
) -> Result<Vec<String>, TrainError> {
    use crate::server::{ChatMessage, ChatTemplate};
    const MARK: &str = "\u{1}";
    let template =
        ChatTemplate::from_tokenizer(tokenizer).map_err(|e| TrainError::Prompt(format!("{e}")))?;
    let text = template
        .render(&[ChatMessage::text("user", MARK.into())], true)
        .map_err(|e| TrainError::Prompt(format!("rendering the user cue: {e:?}")))?;
    let (cue, after) = text
        .split_once(MARK)
        .ok_or_else(|| TrainError::Prompt("the chat template drops the user's message".into()))?;
    let close = after.lines().map(str::trim).find(|l| !l.is_empty());
    let cue = tokenizer
        .encode(cue)
        .map_err(|e| TrainError::Prompt(format!("encoding the user cue: {e}")))?;
    let seq_len = cue.len() + SELF_PROMPT_TOKENS;
    let mut kept = Vec::with_capacity(n);
    let mut seen = std::collections::HashSet::new();
    let mut tried = 0;
    for round in 0u64.. {
        if kept.len() >= n {
            break;
        }
        if tried >= 4 * n {
            return Err(TrainError::Prompt(format!(
                "the model closed {} distinct requests of {tried} it was asked to write ({n} wanted)",
                kept.len()
            )));
        }
        let ask = (2 * (n - kept.len())).min(SELF_PROMPT_ROUND);
        tried += ask;
        let seed = seed ^ round.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let written = super::data::generate(
            target,
            std::slice::from_ref(&cue),
            ask,
            seq_len,
            Some(1.0),
            seed,
        )?;
        for (ids, &len) in written.sequences.iter().zip(&written.lens) {
            let raw = tokenizer
                .inner()
                .decode(&ids[cue.len()..len], false)
                .map_err(|e| TrainError::Prompt(format!("decoding a request: {e}")))?;
            let closed = match close.and_then(|c| raw.find(c)) {
                Some(end) => Some(&raw[..end]),
                None => (len < seq_len).then_some(raw.as_str()),
            };
            let Some(request) = closed.map(str::trim).filter(|r| !r.is_empty()) else {
                continue;
            };
            if kept.len() < n && seen.insert(request.to_string()) {
                kept.push(request.to_string());
            }
        }
    }
    Ok(kept)
}

/// `n` prompts of BOS (when the model has one) and 1–4 random ids, avoiding
/// the special ids at the bottom of most vocabularies: for models without
/// a meaningful tokenizer (the embedded test models).
pub fn random_token_prompts(cfg: &ModelConfig, n: usize, seed: u64) -> Vec<Vec<u32>> {
    let vocab = cfg.vocab_size as u64;
    let low = 3.min(vocab - 1);
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let len = 1 + rng.next_u64() % 4;
            let mut p: Vec<u32> = cfg.bos_token_id.into_iter().collect();
            p.extend((0..len).map(|_| (low + rng.next_u64() % (vocab - low)) as u32));
            p
        })
        .collect()
}

/// Token prompts split into the ones the head trains on and the held-out
/// ones its acceptance is measured on (never trained on).
#[derive(Debug, Clone, PartialEq)]
pub struct PromptSet {
    pub train: Vec<Vec<u32>>,
    pub heldout: Vec<Vec<u32>>,
}

impl PromptSet {
    /// The last `heldout` prompts are held out, the rest train.
    pub fn split(mut prompts: Vec<Vec<u32>>, heldout: usize) -> Result<Self, TrainError> {
        if heldout == 0 || prompts.len() <= heldout {
            return Err(TrainError::InvalidOption {
                field: "heldout_seqs",
                reason: format!(
                    "{heldout} held-out prompts need at least one more prompt; have {}",
                    prompts.len()
                ),
            });
        }
        let heldout = prompts.split_off(prompts.len() - heldout);
        Ok(Self {
            train: prompts,
            heldout,
        })
    }

    /// A fingerprint of the prompts and their split (FNV-1a over the
    /// training count and the ids), saved with a checkpoint so a resume
    /// with other prompts is refused.
    pub fn digest(&self) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let count = [self.train.len() as u32, u32::MAX];
        for p in std::iter::once(&count[..])
            .chain(self.train.iter().chain(&self.heldout).map(Vec::as_slice))
        {
            for &t in p.iter().chain([&u32::MAX]) {
                for b in t.to_le_bytes() {
                    h ^= b as u64;
                    h = h.wrapping_mul(0x0000_0100_0000_01b3);
                }
            }
        }
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_builtin_set_is_large_diverse_and_fixed() {
        let all = builtin_all();
        assert!(all.len() > 2500, "{} prompts", all.len());
        let unique: std::collections::HashSet<_> = all.iter().collect();
        assert_eq!(unique.len(), all.len(), "no duplicates");
        assert_eq!(all, builtin_all(), "deterministic");
        assert!(!all.iter().any(|p| p.contains("{}")), "every slot filled");
        // The shuffle mixes the kinds: the first hundred hold code, passages
        // and topic requests alike.
        let head = &all[..100];
        assert!(head
            .iter()
            .any(|p| p.contains("function") || p.contains("code")));
        assert!(head.iter().any(|p| p.contains(": ")));
        assert!(head.iter().any(|p| p.ends_with('?')));
        assert_eq!(builtin(all.len() + 3)[all.len() + 2], all[2]);
    }

    #[test]
    fn split_holds_out_the_last_prompts_and_digests_differ() {
        let p: Vec<Vec<u32>> = (0..5u32).map(|i| vec![i, i + 1]).collect();
        let s = PromptSet::split(p.clone(), 2).unwrap();
        assert_eq!(s.train, p[..3]);
        assert_eq!(s.heldout, p[3..]);
        let other = PromptSet::split(p.clone(), 1).unwrap();
        assert_ne!(s.digest(), other.digest());
        assert!(matches!(
            PromptSet::split(p, 5),
            Err(TrainError::InvalidOption {
                field: "heldout_seqs",
                ..
            })
        ));
    }
}
