//! The slot registry: every per-sequence store of the engine, and the one
//! place a sequence enters or leaves them.
//!
//! # Invariants
//! - A slot is in all of its stores or in none: [`Sequences::admit`]
//!   registers it in the KV cache, the sampler, the draft head and the
//!   draft policy (those two only when it drafts) and in the slot table; on
//!   any failure it calls [`Sequences::release`], which removes the slot
//!   from every store and is a no-op for stores that never had it.
//! - Until the prompt is done `Sequence::prefilled` equals the KV length
//!   (it starts at the cached prefix's length); afterwards the KV holds
//!   `prompt + generated - 1` positions (the last sampled token is fed by
//!   the next decode).
//! - Preemption ([`Sequences::preempt`]) drops only the KV: the sampler
//!   (seed and generation index, penalty history), the draft head and the generated tokens
//!   stay, so after [`Sequences::resume`] and the recompute (prefill work
//!   over prompt + generated tokens but the last, `recompute` set until it
//!   is done) the sequence continues exactly as if never preempted.
//! - For a draft head that needs hidden states, the KV cache stores the
//!   target's hidden state of every computed position
//!   ([`KvCache::store_hidden`]), cached prefixes included, and
//!   `hidden_from` is the first position the head has not consumed: its
//!   next round 0 reads positions `hidden_from..` from there.
//! - The end-of-sequence rule ([`Sequence::append`]) is applied here only.

use std::collections::HashMap;
use std::sync::Arc;

use super::draft_heads::DraftHead;
use super::errors::{kv_err, model_err};
use super::policy::DraftPolicy;
use super::spec::{Drafting, SpecConfig};
use super::{
    Admission, EngineError, GeneratedToken, KvGrant, Resume, SeqFinish, SlotId, SpecOptions,
    MAX_DRAFT_TOKENS,
};
use crate::kv::KvCache;
use crate::sampler::{Sampler, SamplingOptions};
use crate::structured::Grammar;

/// One sequence's progress, as the engine sees it.
pub(crate) struct Sequence {
    pub prompt: Arc<[u32]>,
    pub prefilled: usize,
    /// While recomputing after a preemption: the KV length to reach
    /// (`prompt + generated - 1`) before decoding again.
    pub recompute: Option<usize>,
    pub last_token: Option<u32>,
    /// Generated token ids, in order (MTP heads pair hidden states with them).
    pub generated: Vec<u32>,
    pub max_new_tokens: usize,
    pub sampling: SamplingOptions,
    /// The first position whose hidden state the draft head has not
    /// consumed (heads that need hidden states; see the module docs).
    pub hidden_from: usize,
    /// The grammar every sampled token follows: its state has accepted
    /// exactly `generated` (EOS and stop ids aside). Lent to the mask
    /// worker during the forward pass (`None` meanwhile, see
    /// `engine::masks`).
    pub grammar: Option<Grammar>,
    /// Ids that end the sequence like an EOS.
    pub stop_ids: Vec<u32>,
}

impl Sequence {
    pub fn prompt_done(&self) -> bool {
        self.recompute.is_none() && self.prefilled >= self.prompt.len()
    }

    /// The KV length prefill work may reach: the prompt, or the recompute
    /// target.
    pub fn fill_target(&self) -> usize {
        self.recompute.unwrap_or(self.prompt.len())
    }

    /// Token at `position` of the whole sequence (prompt, then generated).
    pub fn token_at(&self, position: usize) -> Option<u32> {
        match position.checked_sub(self.prompt.len()) {
            None => self.prompt.get(position).copied(),
            Some(i) => self.generated.get(i).copied(),
        }
    }

    /// The whole sequence so far: prompt, then generated tokens.
    pub fn history(&self) -> Vec<u32> {
        let mut all = Vec::with_capacity(self.prompt.len() + self.generated.len());
        all.extend_from_slice(&self.prompt);
        all.extend_from_slice(&self.generated);
        all
    }

    /// Drafts a decode at KV length `offset` may carry: the bonus token
    /// counts against `max_new_tokens`, and no draft runs past the context.
    pub fn draft_room(&self, offset: usize, context_len: usize) -> usize {
        let remaining = self.max_new_tokens.saturating_sub(self.generated.len());
        remaining
            .saturating_sub(1)
            .min(context_len.saturating_sub(offset + 1))
            .min(MAX_DRAFT_TOKENS)
    }

    /// The end-of-sequence rule: appends `tokens` in order up to and
    /// including the first that ends the sequence (an EOS, or the last one
    /// `max_new_tokens` allows), then checks the context. Returns the tokens
    /// kept and why the sequence ended, if it did.
    pub fn append(
        &mut self,
        tokens: Vec<GeneratedToken>,
        eos_ids: &[u32],
        context_len: usize,
    ) -> (Vec<GeneratedToken>, Option<SeqFinish>) {
        let mut kept = Vec::with_capacity(tokens.len());
        let mut finish = None;
        for token in tokens {
            let id = token.id;
            self.last_token = Some(id);
            self.generated.push(id);
            kept.push(token);
            if eos_ids.contains(&id) || self.stop_ids.contains(&id) {
                finish = Some(SeqFinish::Eos);
                break;
            }
            if self.generated.len() >= self.max_new_tokens {
                finish = Some(SeqFinish::Length);
                break;
            }
        }
        let full = self.prompt.len() + self.generated.len() >= context_len;
        if finish.is_none() && !kept.is_empty() && full {
            finish = Some(SeqFinish::ContextFull);
        }
        (kept, finish)
    }
}

/// Every per-sequence store, and the sequences registered in them.
pub(crate) struct Sequences {
    pub kv: KvCache,
    pub sampler: Sampler,
    pub head: Option<Box<dyn DraftHead>>,
    pub policy: DraftPolicy,
    /// The options a request that does not say gets; `Some` iff the
    /// engine has a drafter (a head, prompt lookup, or both).
    pub default_spec: Option<SpecOptions>,
    #[cfg(debug_assertions)]
    pub accept_all: bool,
    seqs: HashMap<SlotId, Sequence>,
}

impl Sequences {
    pub fn new(kv: KvCache, sampler: Sampler) -> Self {
        Self {
            kv,
            sampler,
            head: None,
            policy: DraftPolicy::new(false, None),
            default_spec: None,
            #[cfg(debug_assertions)]
            accept_all: false,
            seqs: HashMap::new(),
        }
    }

    /// Installs the drafters (before any sequence is admitted): `head`
    /// and/or `config.prompt_lookup`; with neither, nobody drafts.
    pub fn set_drafters(&mut self, head: Option<Box<dyn DraftHead>>, config: SpecConfig) {
        self.policy = DraftPolicy::new(head.is_some(), config.prompt_lookup);
        let any = head.is_some() || config.prompt_lookup.is_some();
        self.head = head;
        self.default_spec = any.then_some(config.default);
        #[cfg(debug_assertions)]
        {
            self.accept_all = config.unchecked_accept;
        }
    }

    pub fn get(&self, slot: SlotId) -> Option<&Sequence> {
        self.seqs.get(&slot)
    }

    pub fn get_mut(&mut self, slot: SlotId) -> Result<&mut Sequence, EngineError> {
        self.seqs
            .get_mut(&slot)
            .ok_or(EngineError::UnknownSlot(slot))
    }

    /// Registers a sequence in every store it needs; on failure it is in none.
    pub fn admit(&mut self, a: Admission) -> Result<(), EngineError> {
        if self.seqs.contains_key(&a.slot) {
            // The registered sequence keeps its stores.
            return Err(EngineError::DuplicateSlot(a.slot));
        }
        let slot = a.slot;
        let result = self.register(a);
        if result.is_err() {
            self.release(slot);
        }
        result
    }

    fn register(&mut self, a: Admission) -> Result<(), EngineError> {
        let slot = a.slot;
        if a.prompt.is_empty() || a.max_new_tokens == 0 {
            return Err(EngineError::InvalidWork {
                slot,
                reason: "empty prompt or max_new_tokens 0".into(),
            });
        }
        let max_tokens = a.prompt.len().saturating_add(a.max_new_tokens);
        let cached = match a.kv {
            KvGrant::Reserve(tokens) => {
                self.kv
                    .allocate(slot, tokens)
                    .map_err(|e| kv_err(slot, e))?;
                0
            }
            KvGrant::Blocks {
                table,
                cached_tokens,
            } => {
                if cached_tokens >= a.prompt.len() {
                    return Err(EngineError::InvalidWork {
                        slot,
                        reason: format!(
                            "{cached_tokens} cached tokens of a {}-token prompt",
                            a.prompt.len()
                        ),
                    });
                }
                self.kv
                    .register(slot, table, cached_tokens)
                    .map_err(|e| kv_err(slot, e))?;
                cached_tokens
            }
        };
        self.sampler.add(slot, a.sampling, &a.prompt)?;
        let constraints = a.constraints;
        if !constraints.logit_bias.is_empty() {
            self.sampler.set_logit_bias(slot, constraints.logit_bias)?;
        }
        if let Some(drafting) = Drafting::resolve(a.spec, self.default_spec) {
            if let Some(head) = self.head.as_mut() {
                head.admit(slot, max_tokens.saturating_add(MAX_DRAFT_TOKENS))
                    .map_err(model_err)?;
            }
            self.policy.admit(slot, drafting);
        }
        self.seqs.insert(
            slot,
            Sequence {
                prompt: a.prompt,
                prefilled: cached,
                recompute: None,
                last_token: None,
                generated: Vec::new(),
                max_new_tokens: a.max_new_tokens,
                sampling: a.sampling,
                hidden_from: 0,
                grammar: constraints.grammar,
                stop_ids: constraints.stop_ids,
            },
        );
        Ok(())
    }

    /// Drops `slot`'s KV (its blocks go back to the scheduler); everything
    /// else stays for [`resume`](Self::resume).
    pub fn preempt(&mut self, slot: SlotId) -> Result<(), EngineError> {
        if !self.seqs.contains_key(&slot) || !self.kv.free(slot) {
            return Err(EngineError::UnknownSlot(slot));
        }
        Ok(())
    }

    /// Gives a preempted `slot` its KV back: `table`, whose first
    /// `cached_tokens` positions are valid; the rest is recomputed.
    pub fn resume(&mut self, r: Resume) -> Result<(), EngineError> {
        let slot = r.slot;
        let seq = self
            .seqs
            .get_mut(&slot)
            .ok_or(EngineError::UnknownSlot(slot))?;
        let target = match seq.generated.len() {
            0 => seq.prompt.len(),
            g => seq.prompt.len() + g - 1,
        };
        if r.cached_tokens > target || (seq.generated.is_empty() && r.cached_tokens == target) {
            return Err(EngineError::InvalidWork {
                slot,
                reason: format!("resume with {} cached of {target}", r.cached_tokens),
            });
        }
        seq.prefilled = r.cached_tokens;
        seq.recompute = (!seq.generated.is_empty() && r.cached_tokens < target).then_some(target);
        self.kv
            .register(slot, r.table, r.cached_tokens)
            .map_err(|e| kv_err(slot, e))
    }

    /// Removes `slot` from every store. Idempotent.
    pub fn release(&mut self, slot: SlotId) {
        self.seqs.remove(&slot);
        self.kv.free(slot);
        self.sampler.remove(slot);
        self.stop_drafting(slot);
    }

    /// `slot` drafts no more (its head state can no longer be trusted).
    pub fn stop_drafting(&mut self, slot: SlotId) {
        if let Some(head) = self.head.as_mut() {
            head.release(slot);
        }
        self.policy.release(slot);
    }

    /// Whether the draft head drafts from the target's hidden states.
    pub fn head_needs_hidden(&self) -> bool {
        self.head.as_ref().is_some_and(|h| h.needs_hidden())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use candle_core::{DType, Device, Tensor};

    use super::*;
    use crate::engine::DraftInput;
    use crate::kv::{KeyOrder, KvLayout};
    use crate::model::{Model, ModelError};

    /// A head that records its slots and fails `admit` when told to.
    struct Recording {
        fail_admit: bool,
        slots: Arc<Mutex<Vec<SlotId>>>,
    }

    impl DraftHead for Recording {
        fn name(&self) -> String {
            "recording".into()
        }
        fn admit(&mut self, slot: SlotId, _reserve: usize) -> Result<(), ModelError> {
            if self.fail_admit {
                return Err(ModelError::InvalidBatch("injected".into()));
            }
            self.slots.lock().unwrap().push(slot);
            Ok(())
        }
        fn release(&mut self, slot: SlotId) {
            self.slots.lock().unwrap().retain(|&s| s != slot);
        }
        fn draft(
            &mut self,
            _: &Model,
            _: &mut KvCache,
            _: &[DraftInput],
        ) -> Result<Tensor, ModelError> {
            unreachable!("no drafting in registry tests")
        }
    }

    fn registry(kv_tokens: usize, fail_head: bool) -> (Sequences, Arc<Mutex<Vec<SlotId>>>) {
        let layout = KvLayout {
            num_layers: 1,
            num_kv_heads: 1,
            head_dim: 4,
            dtype: DType::F32,
            keys: KeyOrder::Rows,
        };
        let mut seqs = Sequences::new(
            KvCache::new(layout, Device::Cpu, kv_tokens),
            Sampler::new(64),
        );
        let slots = Arc::new(Mutex::new(Vec::new()));
        let head = Recording {
            fail_admit: fail_head,
            slots: slots.clone(),
        };
        seqs.set_drafters(Some(Box::new(head)), SpecConfig::default());
        (seqs, slots)
    }

    fn admission(slot: SlotId) -> Admission {
        Admission {
            slot,
            prompt: Arc::from(vec![1u32, 2, 3]),
            sampling: SamplingOptions::greedy(),
            max_new_tokens: 4,
            kv: KvGrant::Reserve(7),
            spec: None,
            constraints: Default::default(),
        }
    }

    fn assert_absent(seqs: &Sequences, head: &Mutex<Vec<SlotId>>, slot: SlotId, case: &str) {
        assert!(seqs.get(slot).is_none(), "{case}: slot table");
        assert!(!seqs.kv.contains(slot), "{case}: KV");
        assert_eq!(seqs.kv.reserved_tokens(), 0, "{case}: KV reservation");
        assert!(!seqs.sampler.contains(slot), "{case}: sampler");
        assert!(!head.lock().unwrap().contains(&slot), "{case}: draft head");
        assert!(!seqs.policy.drafts(slot), "{case}: draft policy");
    }

    #[test]
    fn admit_registers_in_every_store_and_release_undoes_it() {
        let (mut seqs, head) = registry(100, false);
        seqs.admit(admission(4)).unwrap();
        assert!(seqs.get(4).is_some() && seqs.kv.contains(4) && seqs.sampler.contains(4));
        assert!(head.lock().unwrap().contains(&4) && seqs.policy.drafts(4));
        seqs.release(4);
        assert_absent(&seqs, &head, 4, "release");
        seqs.release(4);
        assert_absent(&seqs, &head, 4, "a second release");
    }

    #[test]
    fn a_failure_at_any_store_leaves_the_slot_in_none() {
        // The KV pool is too small.
        let (mut seqs, head) = registry(5, false);
        assert!(matches!(
            seqs.admit(admission(1)),
            Err(EngineError::KvExhausted { .. })
        ));
        assert_absent(&seqs, &head, 1, "KV");
        // The sampler refuses the options.
        let (mut seqs, head) = registry(100, false);
        let bad = Admission {
            sampling: SamplingOptions {
                top_p: 2.0,
                ..Default::default()
            },
            ..admission(1)
        };
        assert!(matches!(seqs.admit(bad), Err(EngineError::Sampler(_))));
        assert_absent(&seqs, &head, 1, "sampler");
        // The draft head refuses the sequence.
        let (mut seqs, head) = registry(100, true);
        assert!(matches!(
            seqs.admit(admission(1)),
            Err(EngineError::Model(_))
        ));
        assert_absent(&seqs, &head, 1, "draft head");
        // The work itself is invalid.
        let (mut seqs, head) = registry(100, false);
        let empty = Admission {
            prompt: Arc::from(Vec::<u32>::new()),
            ..admission(1)
        };
        assert!(matches!(
            seqs.admit(empty),
            Err(EngineError::InvalidWork { .. })
        ));
        assert_absent(&seqs, &head, 1, "invalid work");
    }

    #[test]
    fn a_duplicate_admission_keeps_the_registered_sequence() {
        let (mut seqs, head) = registry(100, false);
        seqs.admit(admission(2)).unwrap();
        assert_eq!(seqs.admit(admission(2)), Err(EngineError::DuplicateSlot(2)));
        assert!(
            seqs.kv.contains(2) && seqs.sampler.contains(2) && head.lock().unwrap().contains(&2)
        );
        assert_eq!(seqs.kv.reserved_tokens(), 7);
    }

    #[test]
    fn end_of_sequence_rule() {
        let token = |id| GeneratedToken {
            id,
            logprob: None,
            top_logprobs: Vec::new(),
        };
        let seq = |max_new_tokens, generated: Vec<u32>| Sequence {
            prompt: Arc::from(vec![1u32, 2]),
            prefilled: 2,
            recompute: None,
            last_token: generated.last().copied(),
            generated,
            max_new_tokens,
            sampling: SamplingOptions::greedy(),
            hidden_from: 0,
            grammar: None,
            stop_ids: vec![9],
        };
        // (max_new, already generated, new tokens, context) → (kept, finish)
        type Case = (usize, Vec<u32>, Vec<u32>, usize, usize, Option<SeqFinish>);
        let table: &[Case] = &[
            (10, vec![], vec![5, 6], 100, 2, None),
            (10, vec![], vec![5, 0, 6], 100, 2, Some(SeqFinish::Eos)),
            (3, vec![4], vec![5, 6, 7], 100, 2, Some(SeqFinish::Length)),
            (10, vec![], vec![5, 6], 4, 2, Some(SeqFinish::ContextFull)),
            (10, vec![], vec![0], 3, 1, Some(SeqFinish::Eos)), // EOS wins over a full context
            (10, vec![], vec![5, 9, 6], 100, 2, Some(SeqFinish::Eos)), // a stop id ends it too
        ];
        for (max_new, before, new, context, kept, finish) in table.iter().cloned() {
            let mut s = seq(max_new, before.clone());
            let (got, why) = s.append(new.iter().map(|&t| token(t)).collect(), &[0], context);
            assert_eq!((got.len(), why), (kept, finish), "{new:?} after {before:?}");
            assert_eq!(s.last_token, got.last().map(|t| t.id));
        }
        // Drafts leave room for the bonus token and stop at the context.
        let s = seq(10, vec![4]);
        assert_eq!(s.draft_room(3, 100), 8);
        assert_eq!(s.draft_room(3, 6), 2);
        assert_eq!(seq(1, vec![]).draft_room(2, 100), 0);
    }
}
