wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = "{\"model\": \"sim-model\", \"max_tokens\": 16, \"messages\": [{\"role\": \"user\", \"content\": \"hello there, how are you\"}]}"
