//! StopFilter and TextStream: stop strings across chunk and token
//! boundaries, hold-back and release, match ranking, payload alignment.

use super::*;

/// Streams `chunks` through a filter; returns (emitted text, emitted
/// payloads, the stop match).
fn run_filter(stops: &[&str], chunks: &[&str]) -> (String, Vec<usize>, Option<StopMatch>) {
    let mut filter = StopFilter::new(stops.iter().map(|s| s.to_string()).collect()).unwrap();
    let (mut text, mut payloads, mut stop) = (String::new(), Vec::new(), None);
    let mut steps: Vec<_> = chunks
        .iter()
        .enumerate()
        .map(|(i, c)| {
            filter.push(TextChunk {
                text: c.to_string(),
                payloads: vec![i],
            })
        })
        .collect();
    steps.push(filter.finish());
    for step in steps {
        for chunk in step.chunks {
            assert!(!chunk.text.is_empty() || !chunk.payloads.is_empty());
            text.push_str(&chunk.text);
            payloads.extend(chunk.payloads);
        }
        if step.stop.is_some() {
            assert!(stop.is_none(), "a stream stops once");
            stop = step.stop;
        }
    }
    (text, payloads, stop)
}

/// Where a stream over `text` must stop: the match that ends first, ties to
/// the earliest start, then list order.
fn expected_cut(text: &str, stops: &[&str]) -> Option<(usize, usize)> {
    stops
        .iter()
        .enumerate()
        .filter_map(|(i, s)| text.find(s).map(|start| (start + s.len(), start, i)))
        .min()
        .map(|(_, start, i)| (start, i))
}

#[test]
fn stop_strings_spanning_chunks_stop_exactly_and_never_leak() {
    let (text, payloads, stop) = run_filter(&["b c"], &["a", " b", " c", " d"]);
    assert_eq!(text, "a ");
    assert_eq!(
        payloads,
        vec![0, 1],
        "` b` starts before the match; ` c` inside it"
    );
    assert_eq!(
        stop,
        Some(StopMatch {
            index: 0,
            stop: "b c".into()
        })
    );

    let mut filter = StopFilter::new(vec!["STOP".into()]).unwrap();
    let mut sent = String::new();
    for piece in ["ok S", "T", "O"] {
        sent.push_str(
            &filter
                .push(TextChunk {
                    text: piece.into(),
                    payloads: vec![()],
                })
                .text(),
        );
        assert_eq!(sent, "ok ", "no prefix of STOP may leak");
    }
    let step = filter.push(TextChunk {
        text: "P and more".into(),
        payloads: vec![()],
    });
    assert!(step.chunks.is_empty());
    assert_eq!(step.stop.unwrap().stop, "STOP");
}

#[test]
fn held_back_partial_matches_are_released_when_they_do_not_match() {
    let mut filter = StopFilter::new(vec!["</answer>".into()]).unwrap();
    let step = filter.push(TextChunk {
        text: "x </ans".into(),
        payloads: vec![0],
    });
    assert_eq!(step.text(), "x ");
    assert_eq!(filter.held_text(), "</ans");
    let step = filter.push(TextChunk {
        text: "wer".into(),
        payloads: vec![1],
    });
    assert!(step.chunks.is_empty());
    let step = filter.push(TextChunk {
        text: "s>".into(),
        payloads: vec![2],
    });
    assert_eq!(step.text(), "</answers>");
    assert_eq!(
        step.chunks
            .iter()
            .map(|c| c.payloads.clone())
            .collect::<Vec<_>>(),
        vec![vec![], vec![1], vec![2]]
    );
    // Held text is released by finish.
    filter.push(TextChunk {
        text: " </an".into(),
        payloads: vec![3],
    });
    let step = filter.finish();
    assert_eq!(step.text(), "</an");
    assert_eq!(step.stop, None);
}

#[test]
fn the_match_that_completes_first_wins() {
    let (text, _, stop) = run_filter(&["box", "big"], &["a big", " box"]);
    assert_eq!((text.as_str(), stop.unwrap().index), ("a ", 1));
    // "bc" completes before "abcd" does, however the text is chunked.
    for chunks in [&["abcd"][..], &["ab", "cd"], &["a", "b", "c", "d"]] {
        let (text, _, stop) = run_filter(&["abcd", "bc"], chunks);
        assert_eq!((text.as_str(), stop.unwrap().index), ("a", 1), "{chunks:?}");
    }
    // Same end: the earlier start (longer string) cuts more.
    let (text, _, stop) = run_filter(&["c", "b c"], &["a b c"]);
    assert_eq!((text.as_str(), stop.unwrap().index), ("a ", 1));
}

#[test]
fn empty_stop_strings_are_rejected() {
    let tok = Arc::new(word_level_tokenizer(200, 1).unwrap());
    let err = TextStream::<()>::new(tok, vec!["ok".into(), String::new()]).unwrap_err();
    assert!(matches!(err, TokenizerError::EmptyStopString { index: 1 }));
    assert!(err.to_string().contains("stop[1]"));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn stop_filter_output_does_not_depend_on_chunking(
        text in "[ab c]{0,24}",
        stops in prop::collection::vec("[ab c]{1,4}", 0..3),
        cuts in prop::collection::vec(0usize..25, 0..8),
    ) {
        let mut cuts: Vec<usize> = cuts.into_iter().filter(|&c| c <= text.len()).collect();
        cuts.push(0);
        cuts.push(text.len());
        cuts.sort_unstable();
        cuts.dedup();
        let chunks: Vec<&str> = cuts.windows(2).map(|w| &text[w[0]..w[1]]).collect();
        let stop_refs: Vec<&str> = stops.iter().map(String::as_str).collect();
        let (out, payloads, stop) = run_filter(&stop_refs, &chunks);
        match expected_cut(&text, &stop_refs) {
            Some((cut, index)) => {
                prop_assert_eq!(&out, &text[..cut]);
                prop_assert_eq!(stop.map(|s| s.index), Some(index));
                // Exactly the chunks that start before the match are paid out.
                let starts: Vec<usize> = (0..chunks.len()).filter(|&i| cuts[i] < cut).collect();
                prop_assert_eq!(payloads, starts);
            }
            None => {
                prop_assert_eq!(&out, &text);
                prop_assert_eq!(stop, None);
                prop_assert_eq!(payloads, (0..chunks.len()).collect::<Vec<_>>());
            }
        }
    }
}

/// Streams `ids` through a TextStream with prompt `context`; returns the
/// text, the payloads and the stop match.
fn run_stream(
    tok: &Arc<Tokenizer>,
    stops: &[&str],
    context: &[u32],
    ids: &[u32],
) -> (String, Vec<usize>, Option<StopMatch>) {
    let stops = stops.iter().map(|s| s.to_string()).collect();
    let mut stream = TextStream::with_context(tok.clone(), stops, context).unwrap();
    let (mut text, mut payloads) = (String::new(), Vec::new());
    let mut steps = Vec::new();
    for (i, &id) in ids.iter().enumerate() {
        steps.push(stream.push(id, i).unwrap());
    }
    steps.push(stream.finish());
    for step in &steps {
        for chunk in &step.chunks {
            text.push_str(&chunk.text);
            payloads.extend(chunk.payloads.iter().copied());
        }
    }
    (text, payloads, stream.stop_match().cloned())
}

#[test]
fn text_stream_on_stories260k_stops_at_every_substring_exactly() {
    let Some(tok) = load(STORIES) else { return };
    let prompt = tok.encode("Once upon a time").unwrap();
    let reference = stories_reference();
    let generated = reference_ids(&reference["prompts"][0], "generated_ids");
    let full = reference["prompts"][0]["generated_text"].as_str().unwrap();

    let (text, payloads, stop) = run_stream(&tok, &[], &prompt, &generated);
    assert_eq!((text.as_str(), stop), (full, None));
    assert_eq!(payloads, (0..generated.len()).collect::<Vec<_>>());

    // Every substring of length 1..=7 starting at a character boundary.
    let mut checked = 0;
    for (start, _) in full.char_indices() {
        for len in 1..=7 {
            let Some(stop) = full.get(start..start + len) else {
                continue;
            };
            let cut = full.find(stop).unwrap();
            let (text, payloads, matched) = run_stream(&tok, &[stop], &prompt, &generated);
            assert_eq!(text, full[..cut], "stop {stop:?}");
            assert_eq!(matched.map(|m| m.stop), Some(stop.to_owned()));
            assert!(
                payloads.windows(2).all(|w| w[1] == w[0] + 1)
                    && payloads.first().is_none_or(|&p| p == 0)
            );
            checked += 1;
        }
    }
    assert!(checked > 500, "{checked}");
    eprintln!("checked {checked} stop strings");

    // "Lily's mom said" ends the text: "said." is held to the end, then
    // released by finish.
    let (text, _, stop) = run_stream(&tok, &["said."], &prompt, &generated);
    assert_eq!((text.as_str(), stop), (full, None));
}

#[test]
fn text_stream_over_word_vocab_with_payload_alignment() {
    let tok = Arc::new(word_level_tokenizer(500, 11).unwrap());
    let word = |id: u32| tok.inner().id_to_token(id).unwrap();
    // Words from id `w` on (the ids before are specials, punctuation, glue).
    let w = tandem::tokenizer::word_vocab::FIXED_TOKENS as u32;
    let ids: Vec<u32> = vec![w, w + 1, 3, w + 2, w + 3, w + 4, 4, w + 5];
    let full = tok.decode(&ids).unwrap();
    assert_eq!(
        full,
        format!(
            "{} {}. {} {} {}, {}",
            word(w),
            word(w + 1),
            word(w + 2),
            word(w + 3),
            word(w + 4),
            word(w + 5)
        )
    );
    let stop = format!("{} {}", word(w + 3), word(w + 4));
    let (text, payloads, matched) = run_stream(&tok, &[&stop], &[], &ids);
    let cut = full.find(&stop).unwrap();
    assert_eq!(text, full[..cut]);
    // Token 4's text (" word23") starts with the space before the match, so
    // its payload goes out with that space; token 5 (" word24") starts inside
    // the match and is dropped with everything after it.
    assert_eq!(payloads, vec![0, 1, 2, 3, 4]);
    assert_eq!(matched.unwrap().index, 0);
}
