// What llama.cpp makes of a GGUF file, for tests/test_gguf_llama_cpp.py: node-llama-cpp's prebuilt llama.cpp
// (CPU), driven through its documented API. One process for every model and text (loading the binding once).
//
// usage: POROS_NODE_LLAMA_CPP=DIR node tests/llama_cpp_check.mjs REQUEST.json OUT_DIR
//   DIR: the folder node-llama-cpp was installed into (npm install --prefix DIR node-llama-cpp)
//   REQUEST: {"models": [{"name", "path", "texts": [...], "prompts": [...], "greedy": N, "logits": bool}]}
//   OUT_DIR/NAME.json: {"tokens": [[ids of each text]], "prompt_tokens": [[...]], "greedy": [[N ids]]}
//   OUT_DIR/NAME.logits.f32: the first-token logits of each prompt, prompts x vocab, little-endian float32
// Tokens are what llama.cpp feeds the model: BOS first where the file says add_bos, special tokens parsed
// (as transformers' encode does). Greedy: temperature 0, no penalties. The KV cache in f32, no flash attention.
import fs from "node:fs";
import {createRequire} from "node:module";
import path from "node:path";
import {pathToFileURL} from "node:url";

const installed = createRequire(path.join(process.env.POROS_NODE_LLAMA_CPP, "package.json")).resolve("node-llama-cpp");
const {getLlama, LlamaLogLevel} = await import(pathToFileURL(installed).href);

const [requestPath, outDir] = process.argv.slice(2);
const request = JSON.parse(fs.readFileSync(requestPath, "utf8"));
const llama = await getLlama({gpu: false, build: "never", usePrebuiltBinaries: true, skipDownload: true,
    logLevel: LlamaLogLevel.error, maxThreads: 1, progressLogs: false});  // 1 thread: the tiny model is latency-bound

function encode(model, text) {
    const tokens = model.tokenize(text, true);
    const bos = model.tokens.shouldPrependBosToken && model.tokens.bos != null ? [model.tokens.bos] : [];
    const eos = model.tokens.shouldAppendEosToken && model.tokens.eos != null ? [model.tokens.eos] : [];
    return [...bos, ...tokens, ...eos].map(Number);
}

for (const spec of request.models) {
    const model = await llama.loadModel({modelPath: spec.path, gpuLayers: 0});
    const context = await model.createContext({contextSize: spec.context ?? 1024, batchSize: spec.context ?? 1024,
        threads: 1, sequences: 1, flashAttention: false,
        // llama.cpp keeps K and V in f16 by default: f32 keeps the file's type the only difference
        experimentalKvCacheKeyType: "F32", experimentalKvCacheValueType: "F32"});
    const sequence = context.getSequence();
    const result = {tokens: spec.texts.map((text) => encode(model, text)), prompt_tokens: [], greedy: []};
    const rows = [];
    for (const prompt of spec.prompts) {
        const tokens = encode(model, prompt);
        result.prompt_tokens.push(tokens);
        await sequence.clearHistory();
        const last = tokens.length - 1;
        const input = tokens.map((token, index) => index < last ? token
            : [token, {generateNext: {token: true, logits: spec.logits, options: {temperature: 0}}}]);
        const [first] = (await sequence.controlledEvaluate(input)).slice(last);
        let next = first.next.token;
        if (spec.logits) {
            const row = new Float32Array(spec.vocab);
            row.fill(Number.NaN);
            for (const [token, logit] of first.next.logits) row[Number(token)] = logit;
            rows.push(row);
        }
        const greedy = [];
        for (let step = 0; step < spec.greedy && next != null; step++) {
            greedy.push(Number(next));
            if (step + 1 === spec.greedy) break;
            const [out] = await sequence.controlledEvaluate([[next, {generateNext: {token: true,
                options: {temperature: 0}}}]]);
            next = out.next.token;
        }
        result.greedy.push(greedy);
    }
    fs.writeFileSync(path.join(outDir, `${spec.name}.json`), JSON.stringify(result));
    if (spec.logits) {
        const all = new Float32Array(rows.length * spec.vocab);
        rows.forEach((row, index) => all.set(row, index * spec.vocab));
        fs.writeFileSync(path.join(outDir, `${spec.name}.logits.f32`), Buffer.from(all.buffer));
    }
    await context.dispose();
    await model.dispose();
}
await llama.dispose();
