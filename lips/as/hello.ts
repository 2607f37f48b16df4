// hello (AssemblyScript): the paper's basic autoregressive decoding, as lips/hello.c.
// Usage: hello [PROMPT] [MAX_TOKENS]. The next-token distribution comes to the guest, which
// takes its argmax and streams the text: the same tokens as the C and Rust builds.
import { args, Context, detokenizeIds, sendText } from "../../guest_sdk/assemblyscript/symphony";

let sent = 0;

function stream(c: Context): void {
  // A character whose tokens have not all come yet decodes as U+FFFD (one per byte so far)
  // until complete: hold it back (finish sends it, if it never completes).
  let text = c.text();
  let end = text.length;
  while (end > 0 && text.charCodeAt(end - 1) == 0xfffd) end--;
  sendBeyond(text.substring(0, end));
}

function sendBeyond(text: string): void {
  const bytes = String.UTF8.byteLength(text);
  if (bytes > sent) {
    const data = Uint8Array.wrap(String.UTF8.encode(text));
    sendText(String.UTF8.decode(data.slice(sent).buffer));
    sent = bytes;
  }
}

const argv = args();
const prompt = argv.length > 1 ? argv[1] : "Once upon a time";
const maxTokens = argv.length > 2 ? I32.parseInt(argv[2]) : 32;
const context = Context.create();
context.fill(prompt);
stream(context);
context.generate(maxTokens, null, true, stream);
sendBeyond(context.text());
sendText("\n");
context.close();
