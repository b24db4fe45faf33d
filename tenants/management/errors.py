from django.core.exceptions import ValidationError


def describe_validation_error(error: ValidationError) -> str:
    """One line for a command's error message."""
    if hasattr(error, "message_dict"):
        return "; ".join(f"{field}: {' '.join(msgs)}" for field, msgs in error.message_dict.items())
    return " ".join(error.messages)
