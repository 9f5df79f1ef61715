from transformers import AutoModelForCausalLM, AutoTokenizer


def test_tiny_model_dir_loads_and_renders_assistant_mask(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.num_hidden_layers == 4
    messages = [
        {"role": "user", "content": "hello how are you"},
        {"role": "assistant", "content": "i am fine"},
    ]
    encoded = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    # "i am fine" + <end_of_turn> are the assistant tokens (this tokenizer drops whitespace)
    assert sum(encoded["assistant_masks"]) == 4
    assert encoded["input_ids"][0] == tokenizer.bos_token_id
