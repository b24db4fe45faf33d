"""A page's query string that no database takes is a 400, not a 500.

The admin's change lists turn every query parameter into a lookup (``?name=...``,
``?created_at__year=...``) and pass its value to PostgreSQL, which refuses a text holding the
NUL character, and a number past its range, with an error the page never expected. The
platform's own pages check their filters in forms (the console answers a 400 that shows the
page unfiltered); the admin's are Django's. So: a NUL in an admin page's query string is a
400, and a database error of range or data on any page that only reads (GET, HEAD; it wrote
nothing, so its query caused it) is a 400, as Django answers a query string it cannot
parse."""

from collections.abc import Callable

from django.db import DataError
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest
from django.urls import reverse

from config.json_text import NUL

READ_METHODS = frozenset({"GET", "HEAD"})


class QueryValueMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if request.path.startswith(reverse("admin:index")) and any(
            NUL in key or NUL in "".join(values) for key, values in request.GET.lists()
        ):
            return HttpResponseBadRequest(
                "The query string may not hold the NUL character.", content_type="text/plain"
            )
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if request.method in READ_METHODS and isinstance(exception, DataError | OverflowError):
            return HttpResponseBadRequest(
                "A value in the query string is out of range.", content_type="text/plain"
            )
        return None
