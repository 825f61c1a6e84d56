// llama_cpp_probe: load a model into llama.cpp, build a context, print its cache sizes as JSON.
//
// Built and run by tools/llama_cpp_oracle.py against the libllama that llama-cpp-python ships and
// the llama.cpp sources its sdist vendors. It reads the byte counts llama.cpp itself computes
// (llama_kv_cache::size_k_bytes / size_v_bytes, llama_memory_recurrent::size_r_bytes / size_s_bytes,
// the cell counts, and llama_get_memory_breakdown for buffer and compute sizes), so the fixture
// holds exact bytes, not the rounded MiB of the log.
//
// usage: llama_cpp_probe MODEL.gguf META|FILE n_ctx n_seq_max type_k type_v flash_attn kv_unified swa_full n_ubatch [OPTION...]
//   META: the GGUF holds metadata only; tensors are created by llama_model_init_from_user (zeros)
//   FILE: a complete GGUF loaded with llama_model_load_from_file
// options:
//   rpc=HOST:PORT   add an RPC device (a ggml-rpc-server): llama.cpp offloads to it as to a GPU
//   ngl=N           n_gpu_layers (default 0)
//   ot=REGEX        keep the tensors matching REGEX in host memory (as -ot REGEX=CPU, --cpu-moe, --n-cpu-moe)
//   outputs=N       n_outputs_max (llama-server: n_parallel, one output per sequence; default: n_batch)
//   logits=PATH tokens=ID,ID,...  decode the tokens as one batch and write every position's logits (f32) to PATH
//   mmproj=PATH     load a vision projector with mtmd on the CPU, with and without its warm-up reserve (flash
//                   attention as flash_attn says): "mmproj" holds its weight bytes and the bytes of the compute
//                   buffer clip reserves for the warm-up image (mtmd_get_memory_usage, the difference of the two),
//                   and the splits and nodes of that graph (clip's log)
// Besides the caches it prints, per buffer type, the model / context / compute bytes of llama_get_memory_breakdown
// and the bytes of the weight tensors placed there (ggml_nbytes, without the buffers' alignment padding).

// the size accessors are private members of exported classes; this tool only reads them
#define private public
#include "llama.h"
#include "llama-ext.h"
#include "llama-kv-cache.h"
#include "llama-kv-cache-iswa.h"
#include "llama-memory-hybrid.h"
#include "llama-memory-hybrid-iswa.h"
#include "llama-memory-recurrent.h"
#include "llama-model.h"
#undef private

#include "ggml-backend.h"
#include "ggml-rpc.h"
#include "gguf.h"
#include "mtmd.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <list>
#include <map>
#include <set>
#include <string>
#include <vector>

static std::string g_log;

static void log_cb(ggml_log_level, const char * text, void *) { g_log += text; }

static void zero_tensor(struct ggml_tensor * tensor, void *) {
    ggml_backend_tensor_memset(tensor, 0, 0, ggml_nbytes(tensor));
}

static ggml_type parse_type(const char * name) {
    for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
        const char * tn = ggml_type_name((ggml_type) t);
        if (tn && strcmp(tn, name) == 0) {
            return (ggml_type) t;
        }
    }
    fprintf(stderr, "unknown ggml type %s\n", name);
    exit(2);
}

static std::string kv_json(const char * role, const llama_kv_cache * kv) {
    char buf[512];
    snprintf(buf, sizeof(buf),
             "{\"role\": \"%s\", \"cells\": %u, \"streams\": %u, \"layers\": %zu, \"k_bytes\": %zu, \"v_bytes\": %zu}",
             role, kv->get_size(), kv->get_n_stream(), kv->layers.size(), kv->size_k_bytes(), kv->size_v_bytes());
    return buf;
}

static std::string recr_json(const llama_memory_recurrent * rs) {
    size_t n_layers = 0;
    for (auto * t : rs->r_l) {
        n_layers += t != nullptr;
    }
    char buf[512];
    snprintf(buf, sizeof(buf),
             "{\"role\": \"recurrent\", \"cells\": %u, \"layers\": %zu, \"r_bytes\": %zu, \"s_bytes\": %zu}",
             rs->size, n_layers, rs->size_r_bytes(), rs->size_s_bytes());
    return buf;
}

static void add_kv(std::vector<std::string> & out, const char * role, const llama_kv_cache * kv) {
    if (kv) out.push_back(kv_json(role, kv));
}

int main(int argc, char ** argv) {
    if (argc < 11) {
        fprintf(stderr, "usage: %s MODEL META|FILE n_ctx n_seq_max type_k type_v flash_attn kv_unified swa_full n_ubatch\n", argv[0]);
        return 2;
    }
    llama_log_set(log_cb, nullptr);
    llama_backend_init();

    llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = 0;
    std::list<std::string> patterns;
    std::vector<llama_model_tensor_buft_override> overrides;
    std::string logits_path;
    std::string mmproj_path;
    std::vector<llama_token> tokens;
    uint32_t n_outputs_max = 0;
    for (int i = 11; i < argc; ++i) {
        std::string arg = argv[i];
        std::string key = arg.substr(0, arg.find('=')), value = arg.substr(arg.find('=') + 1);
        if (key == "rpc") {
            ggml_backend_register(ggml_backend_rpc_add_server(value.c_str()));
        } else if (key == "ngl") {
            mparams.n_gpu_layers = atoi(value.c_str());
        } else if (key == "ot") {
            patterns.push_back(value);
            overrides.push_back({patterns.back().c_str(), ggml_backend_cpu_buffer_type()});
        } else if (key == "outputs") {
            n_outputs_max = (uint32_t) atoi(value.c_str());
        } else if (key == "mmproj") {
            mmproj_path = value;
        } else if (key == "logits") {
            logits_path = value;
        } else if (key == "tokens") {
            for (size_t at = 0; at < value.size();) {
                size_t end = value.find(',', at);
                tokens.push_back((llama_token) atoi(value.substr(at, end - at).c_str()));
                at = end == std::string::npos ? value.size() : end + 1;
            }
        } else {
            fprintf(stderr, "unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (!overrides.empty()) {
        overrides.push_back({nullptr, nullptr});
        mparams.tensor_buft_overrides = overrides.data();
    }
    llama_model * model = nullptr;
    if (strcmp(argv[2], "META") == 0) {
        gguf_init_params gparams = { /*no_alloc =*/ true, /*ctx =*/ nullptr };
        gguf_context * meta = gguf_init_from_file(argv[1], gparams);
        if (!meta) { fprintf(stderr, "cannot read %s\n", argv[1]); return 1; }
        model = llama_model_init_from_user(meta, zero_tensor, nullptr, mparams);
    } else {
        model = llama_model_load_from_file(argv[1], mparams);
    }
    if (!model) { fprintf(stderr, "model failed\n%s", g_log.c_str()); return 1; }

    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx      = (uint32_t) atoi(argv[3]);
    cparams.n_seq_max  = (uint32_t) atoi(argv[4]);
    cparams.type_k     = parse_type(argv[5]);
    cparams.type_v     = parse_type(argv[6]);
    cparams.flash_attn_type = atoi(argv[7]) ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cparams.kv_unified = atoi(argv[8]) != 0;
    cparams.swa_full   = atoi(argv[9]) != 0;
    cparams.n_ubatch   = (uint32_t) atoi(argv[10]);
    cparams.n_outputs_max = n_outputs_max;
    cparams.n_threads  = 2;
    cparams.n_threads_batch = 2;

    std::string mmproj_json;
    if (!mmproj_path.empty()) {
        // mtmd_get_memory_usage: the projector's weight bytes plus, after the warm-up reserve, the compute buffer
        // (ggml_backend_sched_get_buffer_size of clip's scheduler); without warm-up the weights alone
        mtmd_context_params mp = mtmd_context_params_default();
        mp.use_gpu = false;
        mp.n_threads = 2;
        mp.flash_attn_type = cparams.flash_attn_type;
        size_t usage[2] = {0, 0};
        for (int warm = 0; warm < 2; ++warm) {
            mp.warmup = warm == 1;
            auto by_device = mtmd_get_memory_usage(mmproj_path.c_str(), mp);
            if (by_device.empty()) { fprintf(stderr, "mmproj failed\n%s", g_log.c_str()); return 1; }
            for (const auto & [dev, bytes] : by_device) {
                usage[warm] += bytes;
            }
        }
        // the warm-up once more through mtmd_init_from_file, for the size of clip's graph it logs
        mtmd_log_set(log_cb, nullptr);
        g_log.clear();
        mp.warmup = true;
        mtmd_context * mctx = mtmd_init_from_file(mmproj_path.c_str(), model, mp);
        if (!mctx) { fprintf(stderr, "mmproj failed\n%s", g_log.c_str()); return 1; }
        mtmd_free(mctx);
        int splits = -1, nodes = -1;
        size_t at = g_log.rfind("graph splits = ");
        if (at != std::string::npos) {
            sscanf(g_log.c_str() + at, "graph splits = %d, nodes = %d", &splits, &nodes);
        }
        char buf[256];
        snprintf(buf, sizeof(buf), ", \"mmproj\": {\"weight_bytes\": %zu, \"compute_bytes\": %zu, \"graph_splits\": %d, "
                 "\"graph_nodes\": %d}", usage[0], usage[1] - usage[0], splits, nodes);
        mmproj_json = buf;
    }

    llama_context * ctx = llama_init_from_model(model, cparams);
    if (!ctx) {
        std::string last = g_log.size() > 600 ? g_log.substr(g_log.size() - 600) : g_log;
        for (auto & c : last) if (c == '"' || c == '\\' || c == '\n') c = ' ';
        printf("{\"error\": \"%s\"}\n", last.c_str());
        return 0;
    }

    std::vector<std::string> caches;
    llama_memory_i * mem = llama_get_memory(ctx);
    if (auto * iswa = dynamic_cast<llama_kv_cache_iswa *>(mem)) {
        add_kv(caches, "base", iswa->get_base());
        add_kv(caches, "swa", iswa->get_swa());
    } else if (auto * kv = dynamic_cast<llama_kv_cache *>(mem)) {
        add_kv(caches, "base", kv);
    } else if (auto * hyb = dynamic_cast<llama_memory_hybrid *>(mem)) {
        add_kv(caches, "base", hyb->get_mem_attn());
        caches.push_back(recr_json(hyb->get_mem_recr()));
    } else if (auto * hyb_iswa = dynamic_cast<llama_memory_hybrid_iswa *>(mem)) {
        add_kv(caches, "base", hyb_iswa->get_mem_attn()->get_base());
        add_kv(caches, "swa", hyb_iswa->get_mem_attn()->get_swa());
        caches.push_back(recr_json(hyb_iswa->get_mem_recr()));
    } else if (auto * rs = dynamic_cast<llama_memory_recurrent *>(mem)) {
        caches.push_back(recr_json(rs));
    }

    if (!logits_path.empty()) {
        llama_batch batch = llama_batch_init((int32_t) tokens.size(), 0, 1);
        for (size_t i = 0; i < tokens.size(); ++i) {
            batch.token[i] = tokens[i];
            batch.pos[i] = (llama_pos) i;
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i] = 1;
        }
        batch.n_tokens = (int32_t) tokens.size();
        if (llama_decode(ctx, batch) != 0) { fprintf(stderr, "decode failed\n%s", g_log.c_str()); return 1; }
        const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
        FILE * f = fopen(logits_path.c_str(), "wb");
        for (size_t i = 0; i < tokens.size(); ++i) {
            fwrite(llama_get_logits_ith(ctx, (int32_t) i), sizeof(float), n_vocab, f);
        }
        fclose(f);
        llama_batch_free(batch);
    }

    // weight tensors by the buffer type holding them (a tensor duplicated for the output layer counts again)
    std::map<std::string, size_t> tensor_bytes;
    std::set<const ggml_tensor *> seen;
    for (const auto & [name, t] : model->tensors_by_name) {
        if (t->buffer && seen.insert(t).second) {
            tensor_bytes[ggml_backend_buft_name(ggml_backend_buffer_get_type(t->buffer))] += ggml_nbytes(t);
        }
    }
    std::string bufts;
    size_t model_bytes = 0, context_bytes = 0, compute_bytes = 0;
    for (const auto & [buft, mb] : llama_get_memory_breakdown(ctx)) {
        model_bytes += mb.model;
        context_bytes += mb.context;
        compute_bytes += mb.compute;
        ggml_backend_dev_t dev = ggml_backend_buft_get_device(buft);
        char buf[512];
        snprintf(buf, sizeof(buf), "%s{\"name\": \"%s\", \"device\": \"%s\", \"host\": %s, \"model\": %zu, "
                 "\"context\": %zu, \"compute\": %zu}", bufts.empty() ? "" : ", ",
                 ggml_backend_buft_name(buft), dev ? ggml_backend_dev_name(dev) : "",
                 ggml_backend_buft_is_host(buft) ? "true" : "false", mb.model, mb.context, mb.compute);
        bufts += buf;
    }

    printf("{\"n_ctx\": %u, \"n_ctx_seq\": %u, \"n_seq_max\": %u, \"n_ubatch\": %u, \"n_batch\": %u, "
           "\"model_bytes\": %zu, \"context_bytes\": %zu, \"compute_bytes\": %zu, \"caches\": [",
           llama_n_ctx(ctx), llama_n_ctx_seq(ctx), llama_n_seq_max(ctx), llama_n_ubatch(ctx), llama_n_batch(ctx),
           model_bytes, context_bytes, compute_bytes);
    for (size_t i = 0; i < caches.size(); ++i) {
        printf("%s%s", i ? ", " : "", caches[i].c_str());
    }
    printf("], \"buffers\": [%s], \"weights\": {", bufts.c_str());
    size_t k = 0;
    for (const auto & [name, nbytes] : tensor_bytes) {
        printf("%s\"%s\": %zu", k++ ? ", " : "", name.c_str(), nbytes);
    }
    printf("}%s}\n", mmproj_json.c_str());

    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
