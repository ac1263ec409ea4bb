// The server this page came from: relative URLs (so the page also works behind a proxy's sub-path),
// JSON bodies sent as application/json, and the API key the user gave, kept in this browser.

const KEY_STORAGE = "lse.apiKey";

export class ApiError extends Error {
  // `error` is the body's error object ({message, type, code, param, ...}) when the server sent one.
  constructor(status, error) {
    super(error?.message ?? `the server answered HTTP ${status}`);
    this.status = status;
    this.error = error ?? {};
  }
}

export const apiKey = {
  get: () => localStorage.getItem(KEY_STORAGE) ?? "",
  set: (key) => (key ? localStorage.setItem(KEY_STORAGE, key) : localStorage.removeItem(KEY_STORAGE)),
};

function headers(hasBody) {
  const result = {};
  const key = apiKey.get();
  if (key) result.Authorization = `Bearer ${key}`;
  if (hasBody) result["Content-Type"] = "application/json";
  return result;
}

async function failure(response) {
  let body = null;
  try {
    body = await response.json();
  } catch {
    // not JSON (a proxy's page): the status says enough
  }
  return new ApiError(response.status, body?.error);
}

export async function getJSON(path) {
  const response = await fetch(path, { headers: headers(false), cache: "no-store" });
  if (!response.ok) throw await failure(response);
  return response.json();
}

export async function postJSON(path, body) {
  const response = await fetch(path, {
    method: "POST", headers: headers(true), body: JSON.stringify(body), cache: "no-store",
  });
  if (!response.ok) throw await failure(response);
  return response.json();
}

// POSTs `body` with stream: true and calls onChunk with each server-sent event's JSON until [DONE].
// Aborting `signal` closes the connection, which the server takes as a cancel (stop_reason cancelled);
// the promise then rejects with an AbortError. An error sent inside the stream rejects with ApiError.
export async function streamJSON(path, body, onChunk, signal) {
  const response = await fetch(path, {
    method: "POST", headers: headers(true), body: JSON.stringify(body), signal, cache: "no-store",
  });
  if (!response.ok) throw await failure(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice("data: ".length);
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new ApiError(response.status, chunk.error);
        onChunk(chunk);
      }
    }
  }
}
