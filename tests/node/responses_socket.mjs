// The official TypeScript SDK in WebSocket mode on /v1/responses (docs/responses.md): `ResponsesWS` sends
// response.create events on one connection, continues the chain by previous_response_id, keeps a store: false
// response on its connection, and steers a running response. Prints one JSON line of what it saw, for the pytest side
// (tests/integration/test_typescript_sdk.py).
//
// Environment: STATESTORE_URL, API_KEY.
import OpenAI from 'openai';
import { ResponsesWS } from 'openai/resources/responses/ws';

const { STATESTORE_URL, API_KEY } = process.env;
const client = new OpenAI({ baseURL: `${STATESTORE_URL}/v1`, apiKey: API_KEY, maxRetries: 0 });
const socket = new ResponsesWS(client);
const events = socket.stream();

// The messages up to the end of one response (its closing event, or an error), and what else the socket sent.
async function untilFinal(onCreated) {
  const seen = [];
  for (;;) {
    const { value, done } = await events.next();
    if (done) throw new Error('the connection closed');
    if (value.type === 'error') throw value.error;
    if (value.type !== 'message') continue;
    const event = value.message;
    seen.push(event);
    if (event.type === 'response.created' && onCreated) onCreated(event.response.id);
    if (['response.completed', 'response.incomplete', 'response.failed', 'error'].includes(event.type)) return seen;
  }
}

socket.send({ type: 'response.create', model: 'echo-1', input: 'hello' });
const first = await untilFinal();
socket.send({ type: 'response.create', model: 'echo-1', input: 'unstored', store: false, previous_response_id: first.at(-1).response.id });
const second = await untilFinal();
socket.send({ type: 'response.create', model: 'echo-1', input: 'steered', store: false, previous_response_id: second.at(-1).response.id });
const third = await untilFinal((id) => socket.send({ type: 'response.steer', previous_response_id: id, input: 'and this' }));
const successor = await untilFinal();
socket.close({ code: 1000, reason: 'done' });

console.log(
  JSON.stringify({
    first: first.map((e) => e.type),
    firstText: first.at(-1).response.output[0].content[0].text,
    secondText: second.at(-1).response.output[0].content[0].text,
    secondId: second.at(-1).response.id,
    third: third.map((e) => e.type),
    successor: {
      previous: successor.at(-1).response.previous_response_id,
      thirdId: third.at(-1).response.id,
      text: successor.at(-1).response.output[0].content[0].text,
    },
  }),
);
