// parallel (AssemblyScript): prefix caching + parallel decoding, as lips/parallel.c.
// Usage: parallel SYSTEM_PROMPT MAX_TOKENS QUERY...
// The system prompt is computed once, each query forks it (pages shared copy-on-write), and
// every step submits one pred per branch before waiting, so the branches share batches.
// Prints "[i] <query + continuation>" per branch.
import { args, Context, fail, isEos, sendText, Ticket, tokenizeText } from "../../guest_sdk/assemblyscript/symphony";

const argv = args();
if (argv.length < 4) fail("usage: parallel SYSTEM_PROMPT MAX_TOKENS QUERY...");
const maxTokens = I32.parseInt(argv[2]);
const shared = Context.create();
shared.fill(argv[1]);
// One prefill: all of the prefix but its last token, which each branch feeds with its query.
const last = shared.tokens.pop();
shared.next(null, false);

const branches = new Array<Context>();
const starts = new Array<i32>();
const done = new Array<bool>();
for (let q = 3; q < argv.length; q++) {
  const branch = shared.fork();
  branch.tokens.push(last);
  starts.push(branch.tokens.length);
  const ids = tokenizeText(argv[q]);
  for (let i = 0; i < ids.length; i++) branch.tokens.push(ids[i]);
  branches.push(branch);
  done.push(false);
}
shared.close();

for (let step = 0; step < maxTokens; step++) {
  const tickets = new Array<Ticket | null>();
  for (let b = 0; b < branches.length; b++) {
    tickets.push(done[b] ? null : branches[b].kv.submitSample(branches[b].pending()));
  }
  for (let b = 0; b < branches.length; b++) {
    const ticket = tickets[b];
    if (ticket === null) continue;
    const token = ticket.token();
    if (isEos(token)) done[b] = true;
    else branches[b].tokens.push(token);
  }
}
for (let b = 0; b < branches.length; b++) {
  sendText("[" + b.toString() + "] " + branches[b].text(starts[b]) + "\n");
  branches[b].close();
}
