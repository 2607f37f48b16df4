//! parallel (Rust): prefix caching + parallel decoding, as lips/parallel.c.
//! Usage: parallel SYSTEM_PROMPT MAX_TOKENS QUERY...
//! The system prompt is computed once, each query forks it (pages shared copy-on-write), and
//! every step submits one pred per branch before waiting, so the branches share batches.
//! Prints "[i] <query + continuation>" per branch.
#[path = "../../guest_sdk/rust/symphony.rs"]
mod symphony;

use symphony::{Context, Result, Sampling};

fn run() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 4 {
        eprintln!("usage: parallel SYSTEM_PROMPT MAX_TOKENS QUERY...");
        std::process::exit(2);
    }
    let max_tokens: usize = args[2].parse().unwrap_or(8);
    let mut shared = Context::new()?;
    shared.fill(&args[1])?;
    // One prefill: all of the prefix but its last token, which each branch feeds with its query.
    let last = shared.tokens.pop().unwrap_or(0);
    shared.next_token(&symphony::Sampler::Host(Sampling::greedy()))?;
    let mut branches = Vec::new();
    for query in &args[3..] {
        let mut branch = shared.fork()?;
        branch.fill_tokens(&[last]);
        let start = branch.tokens.len();
        branch.fill_tokens(&symphony::tokenize(query, false)?);
        branches.push((branch, start, false));
    }
    drop(shared);
    let greedy = Sampling::greedy();
    for _ in 0..max_tokens {
        let mut tickets = Vec::new();
        for (branch, _, done) in branches.iter_mut() {
            tickets.push(if *done { None } else { Some(branch.submit(&greedy)?) });
        }
        for ((branch, _, done), ticket) in branches.iter_mut().zip(tickets) {
            if let Some(ticket) = ticket {
                let token = ticket.token()?;
                if symphony::is_eos(token) {
                    *done = true;
                } else {
                    branch.fill_tokens(&[token]);
                }
            }
        }
    }
    for (i, (branch, start, _)) in branches.iter().enumerate() {
        let text = symphony::detokenize(&branch.tokens[*start..])?;
        symphony::send_str(&format!("[{}] {}\n", i, text))?;
    }
    Ok(())
}

fn main() {
    if let Err(error) = run() {
        eprintln!("parallel: {:?}", error);
        std::process::exit(1);
    }
}
