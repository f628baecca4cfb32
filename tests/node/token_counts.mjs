// The official TypeScript SDK counts the tokens a thread's continue would send (docs/protocol.md §11): `countTokens` with the
// `thread` field (the SDK passes a body field it does not type), then that continue. Prints one JSON line of what it
// saw, for the pytest side (tests/integration/test_typescript_sdk.py).
//
// Environment: STATESTORE_URL, API_KEY.
import Anthropic from '@anthropic-ai/sdk';

const { STATESTORE_URL, API_KEY } = process.env;
const betas = ['message-threads-2026-08-12'];
const client = new Anthropic({ baseURL: STATESTORE_URL, apiKey: API_KEY, maxRetries: 0 });

const first = await client.beta.messages.create({
  model: 'claude-test',
  max_tokens: 64,
  system: 'Be brief.',
  messages: [{ role: 'user', content: 'one' }],
  thread: { type: 'create' },
  betas,
});
const thread = { type: 'continue', previous_message_id: first.id };
const next = [{ role: 'user', content: 'two' }];
const { data: counted, response } = await client.beta.messages
  .countTokens({ model: 'claude-test', messages: next, thread, betas })
  .withResponse();
const second = await client.beta.messages.create({ model: 'claude-test', max_tokens: 64, messages: next, thread, betas });

let refused = null;
try {
  await client.beta.messages.countTokens({ model: 'claude-test', messages: next, thread, betas });
} catch (error) {
  refused = { status: error.status, code: error.error?.error?.details?.error_code };
}

console.log(
  JSON.stringify({
    counted: counted.input_tokens,
    source: response.headers.get('statestore-token-count'),
    input_tokens: second.usage.input_tokens,
    refused,
  }),
);
