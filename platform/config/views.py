from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.templatetags.static import static


def landing(request: HttpRequest) -> HttpResponse:
    return render(request, "landing.html")


def favicon(request: HttpRequest) -> HttpResponse:
    """``/favicon.ico``, which browsers ask for whatever the page says: the app's icon."""
    return redirect(static("chat/favicon.svg"), permanent=True)
