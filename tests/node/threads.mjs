// The official TypeScript SDK's thread helper against a running statestore: send, stream, and a thread that expires
// between two turns (the SDK replays it under a new thread). Prints one JSON line of what it saw, for the pytest side
// (tests/integration/test_typescript_sdk.py) to check against what the backend received.
//
// Environment: STATESTORE_URL, API_KEY, CLOCK_OFFSET_FILE (seconds the server's clock is ahead; written to expire
// the thread), EXPIRE_SECONDS (how far to move that clock).
import { readFileSync, renameSync, writeFileSync, existsSync } from 'node:fs';
import Anthropic from '@anthropic-ai/sdk';

const { STATESTORE_URL, API_KEY, CLOCK_OFFSET_FILE, EXPIRE_SECONDS } = process.env;

function advanceClock(seconds) {
  const text = existsSync(CLOCK_OFFSET_FILE) ? readFileSync(CLOCK_OFFSET_FILE, 'utf8').trim() : '';
  const scratch = `${CLOCK_OFFSET_FILE}.node`;
  writeFileSync(scratch, String((text ? Number(text) : 0) + seconds));
  renameSync(scratch, CLOCK_OFFSET_FILE); // the server reads the file on every clock call: never half of it
}

const client = new Anthropic({ baseURL: STATESTORE_URL, apiKey: API_KEY, maxRetries: 0 });
const thread = client.beta.messages.thread({ model: 'claude-test', max_tokens: 64, system: 'Be brief.' });

const first = await thread.send({ role: 'user', content: 'one' });
const afterFirst = thread.previousMessageId;

const stream = thread.stream({ role: 'user', content: 'two' });
let streamedText = '';
stream.on('text', (delta) => {
  streamedText += delta;
});
const second = await stream.finalMessage();
const afterSecond = thread.previousMessageId;

advanceClock(Number(EXPIRE_SECONDS));
const third = await thread.send({ role: 'user', content: 'three' });

console.log(
  JSON.stringify({
    first: { id: first.id, text: first.content[0].text, previous: afterFirst },
    second: { id: second.id, text: second.content[0].text, streamed: streamedText, previous: afterSecond },
    third: { id: third.id, text: third.content[0].text, previous: thread.previousMessageId },
    messages: thread.messages.length,
  }),
);
