// The factory's window through llama.cpp's own inference: every position's logits for the token ids it is given
// (no BOS added, nothing tokenized), so a GGUF quant is scored on exactly the windows the other engines are.
//
//   qf-llama logits MODEL.gguf N_CTX GPU_LAYERS   stdout: int32 n_vocab, then per request on stdin (int32 n, then n
//                                                 int32 ids) n x n_vocab float32 logits; n = 0 ends it
//   qf-llama tokenize MODEL.gguf                  stdin: UTF-8 text; stdout: its ids as int32 (no BOS, no specials)
#include "llama.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

static void quiet(enum ggml_log_level level, const char * text, void *) {
    if (level >= GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

static bool read_all(void * buf, size_t n) { return fread(buf, 1, n, stdin) == n; }

static llama_model * open_model(const char * path, int gpu_layers, bool vocab_only) {
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = gpu_layers;
    mp.vocab_only = vocab_only;
    llama_model * model = llama_model_load_from_file(path, mp);
    if (!model) {
        fprintf(stderr, "llama.cpp could not load %s\n", path);
        exit(2);
    }
    return model;
}

static int tokenize(const char * path) {
    llama_model * model = open_model(path, 0, true);
    const llama_vocab * vocab = llama_model_get_vocab(model);
    std::string text((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
    std::vector<llama_token> ids(text.size() + 16);
    int32_t n = llama_tokenize(vocab, text.data(), (int32_t) text.size(), ids.data(), (int32_t) ids.size(), false, false);
    if (n < 0) {
        fprintf(stderr, "llama.cpp could not tokenize the text (%d)\n", n);
        return 3;
    }
    fwrite(ids.data(), sizeof(llama_token), n, stdout);
    llama_model_free(model);
    return 0;
}

static int logits(const char * path, int n_ctx, int gpu_layers) {
    llama_model * model = open_model(path, gpu_layers, false);
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n_ctx;
    cp.n_batch = n_ctx;
    cp.n_ubatch = n_ctx < 512 ? n_ctx : 512;
    cp.n_seq_max = 1;
    cp.no_perf = true;
    if (const char * t = getenv("QF_LLAMA_THREADS")) cp.n_threads = cp.n_threads_batch = atoi(t);
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "llama.cpp could not make a context of %d tokens\n", n_ctx);
        return 2;
    }
    fwrite(&n_vocab, sizeof(n_vocab), 1, stdout);
    fflush(stdout);
    llama_batch batch = llama_batch_init(n_ctx, 0, 1);
    int32_t n = 0;
    while (read_all(&n, sizeof(n)) && n > 0) {
        if (n > n_ctx) {
            fprintf(stderr, "a window of %d tokens is longer than the context (%d)\n", n, n_ctx);
            return 3;
        }
        std::vector<llama_token> ids(n);
        if (!read_all(ids.data(), n * sizeof(llama_token))) return 3;
        llama_memory_clear(llama_get_memory(ctx), true);
        batch.n_tokens = n;
        for (int32_t i = 0; i < n; i++) {
            batch.token[i] = ids[i];
            batch.pos[i] = i;
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i] = 1;
        }
        if (int rc = llama_decode(ctx, batch)) {
            fprintf(stderr, "llama_decode failed (%d)\n", rc);
            return 4;
        }
        for (int32_t i = 0; i < n; i++) fwrite(llama_get_logits_ith(ctx, i), sizeof(float), n_vocab, stdout);
        fflush(stdout);
    }
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}

int main(int argc, char ** argv) {
    llama_log_set(quiet, nullptr);
    llama_backend_init();
    std::string mode = argc > 2 ? argv[1] : "";
    int rc = 1;
    if (mode == "tokenize" && argc == 3) rc = tokenize(argv[2]);
    else if (mode == "logits" && argc == 5) rc = logits(argv[2], atoi(argv[3]), atoi(argv[4]));
    else fprintf(stderr, "usage: qf-llama logits MODEL N_CTX GPU_LAYERS | qf-llama tokenize MODEL\n");
    llama_backend_free();
    return rc;
}
