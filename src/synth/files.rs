//! The checkpoint's small files: the tokenizer (`tiktoken.model`, `tokenizer_config.json`),
//! the nested `config.json` and `model.safetensors.index.json`.

use super::*;

/// Rank table: the 256 single bytes, then `n − 256` merges that build lower-case words (with
/// and without a leading space) from earlier tokens, so that English-like text merges.
/// Fixed (independent of the weight seed).
pub(super) fn rank_table(n: usize) -> Vec<Vec<u8>> {
    let mut ranks: Vec<Vec<u8>> = gpt2_byte_order().into_iter().map(|b| vec![b]).collect();
    let mut seen: HashSet<Vec<u8>> = ranks.iter().cloned().collect();
    let mut words: Vec<Vec<u8>> = b"etaoinshrdlcumwfgypbvkjxqz"
        .iter()
        .map(|&c| vec![c])
        .collect();
    let mut spaced: Vec<Vec<u8>> = Vec::new();
    let mut r = Rng(0x6b33_746f_6b65_6e73);
    let mut misses = 0u32;
    while ranks.len() < n {
        // Favour early (frequent) tokens, unless candidates keep colliding.
        let pick = |r: &mut Rng, len: usize| {
            let a = r.below(len);
            if misses > 64 {
                a
            } else {
                a.min(r.below(len))
            }
        };
        let cand: Vec<u8> = match r.below(4) {
            0 => {
                let w = &words[pick(&mut r, words.len())];
                [b" ".as_slice(), w].concat()
            }
            1 if !spaced.is_empty() => {
                let a = &spaced[pick(&mut r, spaced.len())];
                let b = &words[pick(&mut r, words.len())];
                [a.as_slice(), b].concat()
            }
            _ => {
                let a = &words[pick(&mut r, words.len())];
                let b = &words[pick(&mut r, words.len())];
                [a.as_slice(), b].concat()
            }
        };
        if cand.len() > 12 || seen.contains(&cand) {
            misses += 1;
            continue;
        }
        misses = 0;
        seen.insert(cand.clone());
        if cand[0] == b' ' {
            spaced.push(cand.clone());
        } else {
            words.push(cand.clone());
        }
        ranks.push(cand);
    }
    ranks.truncate(n);
    ranks
}

pub(super) fn tiktoken_model(ranks: &[Vec<u8>]) -> String {
    use base64::Engine as _;
    let mut s = String::with_capacity(ranks.len() * 24);
    for (i, t) in ranks.iter().enumerate() {
        s.push_str(&base64::engine::general_purpose::STANDARD.encode(t));
        s.push(' ');
        s.push_str(&i.to_string());
        s.push('\n');
    }
    s
}

pub(super) fn tokenizer_config(n: usize) -> Value {
    let mut dec = serde_json::Map::new();
    for (off, content, special) in NAMED_SPECIALS {
        dec.insert(
            (n + off).to_string(),
            json!({
                "content": content, "lstrip": false, "normalized": false, "rstrip": false,
                "single_word": false, "special": special,
            }),
        );
    }
    json!({
        "added_tokens_decoder": dec,
        "auto_map": { "AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", null] },
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": false,
        "eos_token": "[EOS]",
        "extra_special_tokens": {},
        "model_max_length": 1_048_576,
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
    })
}

// ------------------------------------------------------------------------------------ config

/// The nested `config.json` of a shape (docs/model.md#configjson); over 100 lines because it
/// is the document itself.
#[must_use]
pub fn config_json(shape: Shape, d: &Dims, seed: u64) -> Value {
    let n = d.ranks;
    let (bos, eos, pad, media) = (n, n + 2, n + 255, n + 21);
    let kda_layers: Vec<usize> = (1..=d.layers).filter(|l| !d.is_mla(l - 1)).collect();
    let quant = json!({
        "config_groups": { "group_0": {
            "format": "mxfp4-pack-quantized",
            "input_activations": null,
            "output_activations": null,
            "targets": ["Linear"],
            "weights": {
                "actorder": null, "block_structure": null, "dynamic": false, "group_size": 32,
                "num_bits": 4, "observer": "minmax", "observer_kwargs": {},
                "scale_dtype": "torch.uint8", "strategy": "group", "symmetric": true,
                "type": "float", "zp_dtype": null,
            },
        }},
        "format": "mxfp4-pack-quantized",
        "global_compression_ratio": null,
        "ignore": [
            "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
            "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*",
        ],
        "kv_cache_scheme": null,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    });
    let text = json!({
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "architectures": ["KimiLinearForCausalLM"],
        "attn_res_block_size": d.block,
        "bos_token_id": bos,
        "dtype": "bfloat16",
        "eos_token_id": eos,
        "first_k_dense_replace": 1,
        "hidden_act": "situ",
        "hidden_size": d.hidden,
        "intermediate_size": d.dense_inter,
        "kv_lora_rank": d.kv_lora,
        "latent_moe_use_norm": true,
        "linear_attn_config": {
            "full_attn_layers": d.full_attn,
            "gate_lower_bound": d.gate_lower_bound,
            "head_dim": d.kda_head_dim,
            "kda_layers": kda_layers,
            "num_heads": d.kda_heads,
            "short_conv_kernel_size": d.conv_kernel,
            "use_full_rank_gate": true,
        },
        "max_position_embeddings": 1_048_576,
        "mla_use_nope": true,
        "mla_use_output_gate": true,
        "model_type": "kimi_linear",
        "moe_intermediate_size": d.expert_inter,
        "moe_layer_freq": 1,
        "moe_renormalize": true,
        "moe_router_activation_func": "sigmoid",
        "num_attention_heads": d.mla_heads,
        "num_expert_group": 1,
        "num_experts": d.experts,
        "num_experts_per_token": d.top_k,
        "num_hidden_layers": d.layers,
        "num_key_value_heads": d.mla_heads,
        "num_nextn_predict_layers": 0,
        "num_shared_experts": d.shared,
        "pad_token_id": pad,
        "q_lora_rank": d.q_lora,
        "qk_nope_head_dim": d.nope,
        "qk_rope_head_dim": d.rope,
        "quantization_config": quant,
        "rms_norm_eps": d.rms_norm_eps,
        "routed_expert_hidden_size": d.latent,
        "routed_scaling_factor": 1.0,
        "tie_word_embeddings": false,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "use_cache": true,
        "use_grouped_topk": true,
        "v_head_dim": d.v_dim,
        "vocab_size": d.vocab(),
    });
    json!({
        "architectures": ["KimiK3ForConditionalGeneration"],
        "auto_map": {
            "AutoConfig": "configuration_kimi_k3.KimiK3Config",
            "AutoModel": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
        },
        "bos_token_id": bos,
        "dtype": "bfloat16",
        "eos_token_id": eos,
        "ignore_index": -100,
        "image_placeholder": "<|kimi_image_placeholder|>",
        "k3_synth": { "shape": shape.name(), "seed": seed, "version": 1 },
        "media_placeholder_token_id": media,
        "model_type": "kimi_k3",
        "pad_token_id": pad,
        "text_config": text,
        "tie_word_embeddings": false,
        "vision_config": {
            "merge_kernel_size": [2, 2],
            "mm_hidden_size": 1024,
            "mm_projector_type": "patchmergerv2",
            "patch_size": 14,
            "text_hidden_size": d.hidden,
            "vt_hidden_size": 1024,
            "vt_intermediate_size": 4096,
            "vt_num_attention_heads": 16,
            "vt_num_hidden_layers": 27,
        },
    })
}

pub(super) fn write_file(path: &Path, bytes: &[u8]) -> Result<(), SynthError> {
    let mut f = File::create(path).map_err(io_err(path))?;
    f.write_all(bytes).map_err(io_err(path))?;
    f.sync_all().map_err(io_err(path))
}

pub(super) fn pretty(v: &Value) -> Vec<u8> {
    let mut s = serde_json::to_string_pretty(v).unwrap_or_default();
    s.push('\n');
    s.into_bytes()
}

/// The HF index: `metadata.total_size` and a name-sorted `weight_map` (indent 2).
pub(super) fn write_index(
    dir: &Path,
    names: &mut [(String, u16)],
    files: &[String],
    total: u64,
) -> Result<(), SynthError> {
    names.sort_unstable();
    let path = dir.join("model.safetensors.index.json");
    let f = File::create(&path).map_err(io_err(&path))?;
    let mut w = BufWriter::with_capacity(4 << 20, f);
    let mut body = format!(
        "{{\n  \"metadata\": {{\n    \"total_size\": {total}\n  }},\n  \"weight_map\": {{\n"
    );
    for (i, (name, k)) in names.iter().enumerate() {
        let sep = if i + 1 < names.len() { "," } else { "" };
        let key = serde_json::to_string(name).unwrap_or_default();
        body.push_str(&format!("    {key}: \"{}\"{sep}\n", files[usize::from(*k)]));
        if body.len() > (1 << 20) {
            w.write_all(body.as_bytes()).map_err(io_err(&path))?;
            body.clear();
        }
    }
    body.push_str("  }\n}\n");
    w.write_all(body.as_bytes()).map_err(io_err(&path))?;
    let f = w.into_inner().map_err(|e| SynthError::Io {
        path: path.clone(),
        source: e.into_error(),
    })?;
    f.sync_all().map_err(io_err(&path))
}
