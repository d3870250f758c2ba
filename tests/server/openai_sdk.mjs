// openai_sdk.mjs - nflash serve through the official OpenAI Node SDK: both
// endpoints, plain and streamed, greedy answers equal between the two, an
// error the SDK raises with the server's status and message, and a wrong key.
// Usage: node openai_sdk.mjs BASE_URL API_KEY SDK_DIR  (node's test runner)
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { createRequire } from 'node:module';

const [base, key, sdkDir] = process.argv.slice(2);
const require = createRequire(sdkDir + '/package.json');
const OpenAI = require('openai');
const client = new OpenAI({ baseURL: base + '/v1', apiKey: key, maxRetries: 0 });
const model = (await client.models.list()).data[0].id;

test('models lists the served model', () => {
  assert.ok(model.length > 0);
});

test('completions: plain and streamed give the same greedy text', async () => {
  const args = { model, prompt: 'Once upon a time', max_tokens: 24, temperature: 0 };
  const plain = await client.completions.create(args);
  assert.equal(plain.object, 'text_completion');
  assert.equal(plain.choices[0].finish_reason, 'length');
  assert.equal(plain.usage.completion_tokens, 24);
  assert.ok(plain.choices[0].text.startsWith(', there was a little girl'));
  let text = '', finish = null, usage = null;
  const stream = await client.completions.create({ ...args, stream: true });
  for await (const chunk of stream) {
    text += chunk.choices[0]?.text ?? '';
    finish = chunk.choices[0]?.finish_reason ?? finish;
    usage = chunk.usage ?? usage;
  }
  assert.equal(text, plain.choices[0].text);
  assert.equal(finish, 'length');
  assert.equal(usage.completion_tokens, 24);
});

test('chat completions: plain and streamed give the same greedy text', async () => {
  const args = { model, messages: [{ role: 'system', content: 'Tell a story.' }, { role: 'user', content: 'Hi' }],
                 max_tokens: 16, temperature: 0 };
  const plain = await client.chat.completions.create(args);
  assert.equal(plain.object, 'chat.completion');
  assert.equal(plain.choices[0].message.role, 'assistant');
  const want = plain.choices[0].message.content;
  assert.ok(want.length > 0);
  let text = '', role = null, usage = null;
  const stream = await client.chat.completions.create({ ...args, stream: true, stream_options: { include_usage: true } });
  for await (const chunk of stream) {
    const d = chunk.choices[0]?.delta;
    role = d?.role ?? role;
    text += d?.content ?? '';
    usage = chunk.usage ?? usage;
  }
  assert.equal(role, 'assistant');
  assert.equal(text, want);
  assert.equal(usage.completion_tokens, plain.usage.completion_tokens);
});

test('a bad field is a 400 naming it', async () => {
  await assert.rejects(client.completions.create({ model, prompt: 'x', temperature: 9 }),
    (e) => e.status === 400 && /temperature/.test(e.message) && e.param === 'temperature');
});

test('a wrong key is a 401', async () => {
  const bad = new OpenAI({ baseURL: base + '/v1', apiKey: 'wrong', maxRetries: 0 });
  await assert.rejects(bad.models.list(), (e) => e.status === 401);
});
