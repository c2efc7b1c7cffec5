//! Per-engine health checks and model discovery (spec 03 §9).

use serde::Deserialize;

/// Supported backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// vLLM.
    Vllm,
    /// SGLang.
    Sglang,
    /// Ollama.
    Ollama,
    /// llama.cpp server.
    Llamacpp,
    /// Infinity (embeddings / rerank).
    Infinity,
    /// Any OpenAI-compatible server with `--health-url`.
    Custom,
}

impl Engine {
    /// Parse a flag value.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "vllm" => Engine::Vllm,
            "sglang" => Engine::Sglang,
            "ollama" => Engine::Ollama,
            "llamacpp" => Engine::Llamacpp,
            "infinity" => Engine::Infinity,
            "custom" => Engine::Custom,
            _ => return None,
        })
    }

    /// Wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Engine::Vllm => "vllm",
            Engine::Sglang => "sglang",
            Engine::Ollama => "ollama",
            Engine::Llamacpp => "llamacpp",
            Engine::Infinity => "infinity",
            Engine::Custom => "custom",
        }
    }

    /// Health path on the backend (custom engines use `--health-url`).
    pub fn health_path(self) -> &'static str {
        match self {
            Engine::Ollama => "/api/tags",
            _ => "/health",
        }
    }

    /// Discovery path, if the engine supports discovery.
    pub fn discovery_path(self) -> Option<&'static str> {
        match self {
            Engine::Ollama => Some("/api/tags"),
            Engine::Custom => None,
            _ => Some("/v1/models"),
        }
    }

    /// Whether a one-token warm-up precedes registration (seed: ollama and
    /// sglang load or compile on their first request).
    pub fn needs_warmup(self) -> bool {
        matches!(self, Engine::Ollama | Engine::Sglang)
    }
}

#[derive(Deserialize)]
struct OpenAiModels {
    data: Vec<OpenAiModel>,
}

#[derive(Deserialize)]
struct OpenAiModel {
    id: String,
}

#[derive(Deserialize)]
struct OllamaTags {
    models: Vec<OllamaModel>,
}

#[derive(Deserialize)]
struct OllamaModel {
    name: String,
}

/// First model named by a discovery response.
pub fn discover(engine: Engine, body: &[u8]) -> Result<String, String> {
    match engine {
        Engine::Ollama => {
            let t: OllamaTags =
                serde_json::from_slice(body).map_err(|e| format!("bad /api/tags response: {e}"))?;
            let m = t.models.first().ok_or("backend lists no models")?;
            Ok(m.name
                .strip_suffix(":latest")
                .unwrap_or(&m.name)
                .to_string())
        }
        _ => {
            let m: OpenAiModels = serde_json::from_slice(body)
                .map_err(|e| format!("bad /v1/models response: {e}"))?;
            Ok(m.data.first().ok_or("backend lists no models")?.id.clone())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn discovery() {
        assert_eq!(
            discover(Engine::Vllm, br#"{"data":[{"id":"m1"},{"id":"m2"}]}"#).expect("ok"),
            "m1"
        );
        assert_eq!(
            discover(Engine::Ollama, br#"{"models":[{"name":"llama3:latest"}]}"#).expect("ok"),
            "llama3"
        );
        assert!(discover(Engine::Vllm, br#"{"data":[]}"#).is_err());
        assert!(discover(Engine::Vllm, b"x").is_err());
    }
}
