//! hello (Rust): the paper's basic autoregressive decoding, as lips/hello.c.
//! Usage: hello [PROMPT] [MAX_TOKENS]. The next-token distribution comes to the guest, which
//! takes its argmax and streams the text: the same tokens as the C and AssemblyScript builds.
#[path = "../../guest_sdk/rust/symphony.rs"]
mod symphony;

use symphony::{Context, Result, Sampler, TextStream};

fn run() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let prompt = args.get(1).map(String::as_str).unwrap_or("Once upon a time");
    let max_tokens = args.get(2).and_then(|n| n.parse().ok()).unwrap_or(32);
    let mut context = Context::new()?;
    context.fill(prompt)?;
    let mut stream = TextStream::new();
    stream.update(&context.tokens)?;
    context.generate_until(&Sampler::Argmax, max_tokens, |c, _| drop(stream.update(&c.tokens)), |_| false)?;
    stream.finish(&context.tokens)?;
    symphony::send_str("\n")
}

fn main() {
    if let Err(error) = run() {
        eprintln!("hello: {:?}", error);
        std::process::exit(1);
    }
}
