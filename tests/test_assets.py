from probes.assets import chitchat_to_messages, convert_chitchat, source_id


def conversation(*senders, prompt="what is your favorite food?"):
    groups = [[{"sender": sender, "text": f"t{index}"}] for index, sender in enumerate(senders)]
    return {"messages": groups, "prompt": prompt}


def test_first_sender_is_user_and_other_is_assistant():
    messages = chitchat_to_messages(conversation("a", "b", "a"))
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]


def test_conversion_keeps_every_conversation_and_counts_failures():
    broken = {"messages": [[{"sender": "a", "text": "x"}, {"sender": "b", "text": "y"}]]}
    frame, counts = convert_chitchat([("c1", conversation("a", "b")), ("c2", broken)])
    assert len(frame) == 2
    assert counts == {"conversations": 2, "converted": 1, "not_convertible": 1}
    # the prompt is text from the data: only its hash becomes the source label
    assert frame.loc[0, "source"] == source_id("what is your favorite food?")
    assert "favorite" not in frame.loc[0, "source"]
    assert source_id(None) == "none"
