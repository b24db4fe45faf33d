"""The JSON shapes the page and the WebSocket share for messages and settings."""

from chat.models import Conversation, Message


def message_payload(message: Message) -> dict:
    return {
        "id": message.pk,
        "role": message.role,
        "content": message.content,
        "status": message.status,
        "finish_reason": message.finish_reason,
        "error_code": message.error_code,
        "error_message": message.error_message,
        "model": message.model,
    }


def settings_payload(conversation: Conversation) -> dict:
    return {
        "title": conversation.title,
        "model": conversation.model,
        "system_prompt": conversation.system_prompt,
        "temperature": conversation.temperature,
        "max_tokens": conversation.max_tokens,
    }
