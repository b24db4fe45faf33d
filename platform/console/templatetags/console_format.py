"""Numbers as the console shows them: thousands separated, milliseconds and rates rounded."""

from datetime import datetime, timedelta

from django import template
from django.utils import timezone
from django.utils.timesince import timesince

from console.charts import exact_number

register = template.Library()


@register.filter
def thousands(value: float | None) -> str:
    """12345 -> "12,345"; None -> "–"."""
    return "–" if value is None else exact_number(value)


@register.filter
def ago(moment: datetime | None) -> str:
    """How long ago ``moment`` was: "just now" within a minute, "5 minutes ago"; "never"."""
    if moment is None:
        return "never"
    if timezone.now() - moment < timedelta(minutes=1):
        return "just now"
    return f"{timesince(moment)} ago"


@register.filter
def ms(value: float | None) -> str:
    """A duration in milliseconds: "1,234 ms", "12.5 ms"; None -> "–"."""
    if value is None:
        return "–"
    return f"{value:,.0f} ms" if value >= 100 else f"{value:.1f} ms"


@register.filter
def percent(rate: float | None) -> str:
    """0.0123 -> "1.2%"; None -> "–"."""
    return "–" if rate is None else f"{100 * rate:.1f}%"


@register.filter
def pct(totals: object, spec: str) -> float | None:
    """``totals|pct:"ttft,0.95"``: a percentile of a ``console.usage.Totals`` (ms)."""
    name, q = spec.split(",")
    return totals.percentile(name, float(q))
