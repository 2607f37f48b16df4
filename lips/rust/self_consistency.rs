//! self_consistency (Rust): ask once, answer K times under a grammar, vote; as
//! lips/self_consistency.c (the same draws for the same seed, the same transcript).
//! Usage: self_consistency QUESTION K [MAX_TOKENS] [TEMPERATURE] [SEED]
#[path = "../../guest_sdk/rust/symphony.rs"]
mod symphony;

use symphony::{Grammar, Kv, Result, Sampling, GRAMMAR_REGEX};

const MAX_BRANCHES: usize = 16;
const MAX_ANSWER_TOKENS: usize = 24;
const ANSWER_REGEX: &str = "[A-Za-z0-9][A-Za-z0-9 ]{0,40}";

fn run() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: self_consistency QUESTION K [MAX_TOKENS] [TEMPERATURE] [SEED]");
        std::process::exit(2);
    }
    let k = args[2].parse::<usize>().unwrap_or(1).clamp(1, MAX_BRANCHES);
    let mut max_tokens = args.get(3).and_then(|a| a.parse::<usize>().ok()).unwrap_or(12);
    if max_tokens < 1 || max_tokens > MAX_ANSWER_TOKENS {
        max_tokens = MAX_ANSWER_TOKENS;
    }
    let temperature = args.get(4).and_then(|a| a.parse::<f32>().ok()).unwrap_or(1.0);
    let seed = args.get(5).and_then(|a| a.parse::<u64>().ok()).unwrap_or(0);
    let prompt = symphony::tokenize(&args[1], true)?;
    let root = Kv::create()?;
    if prompt.len() > 1 {
        // The prompt but its last token, which each branch feeds with its first draw.
        root.submit_sample(&prompt[..prompt.len() - 1], &Sampling::greedy())?.token()?;
    }
    let pristine = Grammar::new(GRAMMAR_REGEX, ANSWER_REGEX)?;
    let mut branches = Vec::new();
    for _ in 0..k {
        branches.push((root.fork()?, pristine.fork()?, Vec::<u32>::new(), false));
    }
    for step in 0..max_tokens {
        let mut tickets = Vec::new();
        for (b, (kv, grammar, answer, done)) in branches.iter().enumerate() {
            if *done {
                tickets.push(None);
                continue;
            }
            // Every live branch's pred first: they share the batch.
            let sampling = Sampling {
                temperature,
                top_p: 1.0,
                seed: Some(seed + b as u64 * 1000003 + step as u64),
                grammar: Some(grammar.handle()),
                ..Sampling::default()
            };
            let feed = if step == 0 { prompt[prompt.len() - 1] } else { answer[answer.len() - 1] };
            tickets.push(Some(kv.submit_sample(&[feed], &sampling)?));
        }
        if tickets.iter().all(|t| t.is_none()) {
            break;
        }
        for ((_, grammar, answer, done), ticket) in branches.iter_mut().zip(tickets) {
            if let Some(ticket) = ticket {
                let token = ticket.token()?;
                if symphony::is_eos(token) {
                    *done = true;
                    continue;
                }
                answer.push(token);
                if grammar.must_end()? || answer.len() == max_tokens {
                    *done = true;
                }
            }
        }
    }
    let mut keys = Vec::new();
    for (b, (_, _, answer, _)) in branches.iter().enumerate() {
        let key = symphony::detokenize(answer)?.trim_matches(' ').to_ascii_lowercase();
        symphony::send_str(&format!("[{}] {}\n", b, key))?;
        keys.push(key);
    }
    let votes: Vec<usize> = keys.iter().map(|key| keys.iter().filter(|other| *other == key).count()).collect();
    let most = *votes.iter().max().unwrap_or(&0);
    let best = votes.iter().position(|&v| v == most).unwrap_or(0);
    symphony::send_str(&format!("vote: {} ({} of {})\n", keys[best], most, k))?;
    Ok(())
}

fn main() {
    if let Err(error) = run() {
        eprintln!("self_consistency: {:?}", error);
        std::process::exit(1);
    }
}
