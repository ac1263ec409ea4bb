// The ollama npm package against a live lse-server: tests/test_ollama.py runs this with the package on
// NODE_PATH and the server's address, key, models and conversations as JSON in argv[2]; each call's result
// goes to stdout as one JSON object, which the test compares with what the server gives the Python client.
const { Ollama } = require('ollama')

async function main () {
  const config = JSON.parse(process.argv[2])
  const client = new Ollama({ host: config.host, headers: { Authorization: `Bearer ${config.key}` } })
  const options = { temperature: 0, num_predict: 6 }
  const results = {}

  results.chat = (await client.chat({ model: config.model, messages: config.messages, options })).message
  const parts = []
  for await (const part of await client.chat({ model: config.model, messages: config.messages, options, stream: true })) {
    parts.push(part)
  }
  results.chat_stream = { content: parts.map(p => p.message.content).join(''), last: parts[parts.length - 1] }

  results.generate = (await client.generate({ model: config.model, prompt: config.messages[0].content, options })).response
  results.embed = (await client.embed({ model: config.model, input: ['Hello', 'Paris'] })).embeddings
  results.list = (await client.list()).models.map(m => m.name)
  const shown = await client.show({ model: config.model })
  results.show = { family: shown.details.family, capabilities: shown.capabilities }

  const called = await client.chat({
    model: config.tool_model, messages: config.tool_messages, tools: config.tools, options: { temperature: 0, num_predict: 16 }
  })
  results.tool_calls = called.message.tool_calls

  const formatted = await client.chat({
    model: config.model, messages: config.messages, format: config.schema, think: false, options: { temperature: 0, num_predict: 60 }
  })
  results.format = formatted.message.content

  try {
    await client.pull({ model: config.model })
  } catch (error) {
    results.pull = { status: error.status_code, error: error.error }
  }
  console.log(JSON.stringify(results))
}

main().catch(error => { console.error(error); process.exit(1) })
