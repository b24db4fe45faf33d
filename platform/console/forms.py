"""The console's inputs. Each form bounds what it accepts, so that no value reaches date
arithmetic or the database out of range: a bad value redisplays the page with an error and a
400, never a 500."""

from datetime import date, timedelta

from django import forms

from config.numerals import parse_count
from console.selectors import DateRange
from tenants.invitations import DEFAULT_EXPIRY_DAYS, EXPIRY_DAYS
from tenants.models import Membership
from tenants.services import MAX_KEY_LIFETIME_DAYS

# Usage older than this cannot exist; the bound keeps every date the range derives (its
# default start, its days) far from date.min and date.max.
EARLIEST_DATE = date(2000, 1, 1)
MAX_RANGE_DAYS = 366
DEFAULT_RANGE_DAYS = 14


class DateRangeForm(forms.Form):
    """``start`` and ``end`` (inclusive, ISO dates, both optional) of a usage page."""

    start = forms.DateField(required=False, input_formats=["%Y-%m-%d"])
    end = forms.DateField(required=False, input_formats=["%Y-%m-%d"])

    def __init__(self, data: object, *, today: date) -> None:
        super().__init__(data)
        self.today = today

    def clean(self) -> dict:
        cleaned = super().clean()
        _check_dates(self, cleaned)
        return cleaned

    def date_range(self) -> DateRange:
        """The range asked for (swapped if backwards, cut to its last ``MAX_RANGE_DAYS``
        days), or the last ``DEFAULT_RANGE_DAYS`` days when nothing or something invalid
        was asked for."""
        cleaned = self.cleaned_data if self.is_valid() else {}
        end = cleaned.get("end") or self.today
        start = cleaned.get("start") or end - timedelta(days=DEFAULT_RANGE_DAYS - 1)
        if start > end:
            start, end = end, start
        start = max(start, end - timedelta(days=MAX_RANGE_DAYS - 1))
        return DateRange(start=start, end=end)

    def error_messages(self) -> list[str]:
        return [
            f"{name.title()} date: {message}"
            for name, messages in self.errors.items()
            for message in messages
        ]


class EndUserForm(forms.Form):
    """``end_user`` (optional): the API requests' ``user`` to narrow a tenant's usage to."""

    end_user = forms.CharField(required=False, max_length=256, label="End user")  # as stored

    def end_user_or_none(self) -> str | None:
        """The end user asked for, or None (every request) when none or an invalid one was."""
        return (self.cleaned_data["end_user"] if self.is_valid() else "") or None

    def error_messages(self) -> list[str]:
        return _labelled_errors(self)


class AuditFilterForm(forms.Form):
    """What an audit log page shows: an action, a user's name, a first and a last day; each
    optional (none shows every event, newest first)."""

    action = forms.ChoiceField(required=False)
    actor = forms.CharField(required=False, max_length=150, label="User")
    start = forms.DateField(required=False, input_formats=["%Y-%m-%d"], label="From")
    end = forms.DateField(required=False, input_formats=["%Y-%m-%d"], label="To")

    def __init__(self, data: object, *, actions: list[tuple[str, str]], today: date) -> None:
        super().__init__(data)
        self.fields["action"].choices = [("", "Any action"), *actions]
        self.today = today

    def clean(self) -> dict:
        cleaned = super().clean()
        _check_dates(self, cleaned)
        return cleaned

    def filters(self) -> dict:
        """The valid filters (an invalid one is left unset, a backwards range swapped), as
        ``audit_selectors.audit_filter`` takes them."""
        self.is_valid()
        filters = dict(self.cleaned_data)
        start, end = filters.get("start"), filters.get("end")
        if start is not None and end is not None and start > end:
            filters["start"], filters["end"] = end, start
        return filters

    def error_messages(self) -> list[str]:
        return _labelled_errors(self)


class ApiKeyCreateForm(forms.Form):
    name = forms.CharField(max_length=200, required=False)
    expires_in_days = forms.IntegerField(
        required=False, min_value=1, max_value=MAX_KEY_LIFETIME_DAYS, label="Expires in days"
    )

    def error_messages(self) -> list[str]:
        return _labelled_errors(self)


class InvitationCreateForm(forms.Form):
    role = forms.ChoiceField(choices=Membership.Role.choices, initial=Membership.Role.MEMBER)
    note = forms.CharField(max_length=200, required=False, label="For")
    expires_in_days = forms.TypedChoiceField(
        choices=[(days, f"{days} day{'s' if days > 1 else ''}") for days in EXPIRY_DAYS],
        coerce=int,
        initial=DEFAULT_EXPIRY_DAYS,
        label="Expires in",
    )

    def error_messages(self) -> list[str]:
        return _labelled_errors(self)


def _check_dates(form: DateRangeForm | AuditFilterForm, cleaned: dict) -> None:
    """Refuse a ``start`` or ``end`` too far from the form's ``today`` for date arithmetic."""
    latest = form.today + timedelta(days=MAX_RANGE_DAYS)
    for name in ("start", "end"):
        value = cleaned.get(name)
        if value is not None and not EARLIEST_DATE <= value <= latest:
            form.add_error(name, f"Pick a date from {EARLIEST_DATE} to {latest}.")


def _labelled_errors(form: forms.Form) -> list[str]:
    return [
        f"{form.fields[name].label or name.title()}: {message}"
        for name, messages in form.errors.items()
        for message in messages
    ]


def object_id(value: str | None) -> int | None:
    """A posted object id as an int, or None (which matches no object) when it is not one."""
    return parse_count(value)
