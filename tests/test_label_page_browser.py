"""The labelling page in a real headless Chromium (Debian's `chromium` and `chromium-driver`, driven by
selenium): a person labels a judged run's drawn pairs with the keyboard, sees the counts, the advice and
the decision move, and no answer (each holds a <script>, an <img onerror=...> and javascript: links) runs
anything. Set FLYSPEC_SCREENSHOTS=1 to refresh docs/images/label-page.png from this browser."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from label_runs import hostile_run
from loopback import serve_app

from flyspec.gate.data.results import gold_rule, pending, request_texts
from flyspec.gate.data.store import GateStore
from flyspec.gate.report.build import build_report, label_progress
from flyspec.gate.shadow.label import label_router

pytestmark = pytest.mark.slow
INSTALL = "apt-get install -y chromium chromium-driver (Debian; .ci/run does it) and pip install -e '.[dev]'"
TOKEN = "label-test-token"
SCREENSHOT = Path(__file__).resolve().parent.parent / "docs" / "images" / "label-page.png"


@pytest.fixture
def browser() -> Iterator[object]:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.fail(f"the labelling page's browser test needs Chromium and its driver: {INSTALL}")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail(f"the labelling page's browser test needs selenium: {INSTALL}")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(flag)
    web = webdriver.Chrome(options=options, service=Service(executable_path=driver))
    try:
        yield web
    finally:
        web.quit()


def _nothing_ran(web) -> None:  # type: ignore[no-untyped-def]
    """No answer's script, image handler or link ran: the flag and the title are the page's own, no <img>
    or <a> came from an answer, and the only script is the page's."""
    from selenium.webdriver.common.by import By

    assert web.execute_script("return window.flyspecPwned === undefined") is True
    assert web.title == "flyspec: gold labels"
    assert web.find_elements(By.TAG_NAME, "img") == []
    assert web.find_elements(By.CSS_SELECTOR, ".text a, .text script") == []
    assert len(web.find_elements(By.TAG_NAME, "script")) == 1


def test_label_a_run_in_the_browser(browser, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    web = browser
    store, run_id = hostile_run(tmp_path, questions=40)
    app = FastAPI()
    app.include_router(label_router(store, run_id, TOKEN, progress=label_progress))

    def text(element_id: str) -> str:
        return web.find_element(By.ID, element_id).text

    def wait_for(element_id: str, value: str) -> None:
        never = f"#{element_id} never read {value!r}"
        WebDriverWait(web, 30).until(lambda _: text(element_id) == value, never)

    def press(key: str) -> None:
        ActionChains(web).send_keys(key).perform()

    def better_key() -> str:
        """The key for the answer without the hostile text (the baseline's: it is the better one)."""
        return "b" if "pwned" in text("answer-a") else "a"

    with serve_app(app) as url:
        base = url.removesuffix("/v1")
        web.get(f"{base}/label")  # no token: refused
        assert "needs its token" in web.find_element(By.TAG_NAME, "body").text
        web.get(f"{base}/label?token={TOKEN}")
        name = web.find_element(By.ID, "name")
        WebDriverWait(web, 30).until(lambda _: name.is_displayed())
        name.send_keys("ann\n")
        wait_for("waiting", "8")
        assert text("labelled") == "0" and text("decision").startswith("no decision yet")
        request, answer_a = text("request"), text("answer-a")
        assert "<script>" in text("answer-a") + text("answer-b")  # shown as text
        assert web.find_element(By.CSS_SELECTOR, "#answer-a pre, #answer-b pre").text.startswith("print(")
        _nothing_ran(web)
        web.refresh()  # the same pair, with the same sides
        wait_for("waiting", "8")
        assert (text("request"), text("answer-a")) == (request, answer_a)
        advice = text("advice")
        for done in range(1, 7):
            press(better_key())
            wait_for("labelled", str(done))
            assert text("waiting") == str(8 - done)
            _nothing_ran(web)
            if done == 4:
                assert text("advice") != advice  # the advice follows the labels
                # a count of labels left only where the advice names a rate the run's draw can give
                assert (text("more") == "-") == text("advice").startswith("No label rate")
                if os.environ.get("FLYSPEC_SCREENSHOTS"):
                    web.save_screenshot(str(SCREENSHOT))
        request = text("request")
        press("s")  # skipped for now: the next pair
        WebDriverWait(web, 30).until(lambda _: text("request") != request)
        assert "Skipped for now" in text("message")
        press(better_key())
        wait_for("labelled", "7")
        assert "Only skipped pairs are left" in text("message")
        assert text("decision").startswith("no decision yet")
        web.refresh()  # the skipped pair is back
        wait_for("waiting", "1")
        assert text("request") == request
        press(better_key())
        wait_for("labelled", "8")
        assert text("decision").startswith("FAIL") and text("judge-agreement") == "100%"
        web.find_element(By.ID, "rename").click()  # a second labeller on the same pairs
        name = web.find_element(By.ID, "name")
        name.clear()
        name.send_keys("bob\n")
        WebDriverWait(web, 30).until(lambda _: "a second label" in text("where"))
        press("e")
        wait_for("labeller-agreement", "0 of 1 pairs labelled twice")
        press(better_key())
        wait_for("labeller-agreement", "1 of 2 pairs labelled twice")
        _nothing_ran(web)
    with GateStore(store) as opened:
        labels = opened.labels(run_id)
        assert len(labels) == 8 and {label.value for label in labels.values()} == {-1}
        assert {label.detail["labeller"] for label in labels.values()} == {"ann"}
        assert [s.detail["labeller"] for s in opened.second_labels(run_id)] == ["bob", "bob"]
        run, gold = gold_rule(opened, run_id)
        assert pending(opened, run, gold, request_texts(run)) == []  # `gate label` sees the same queue
    assert build_report(store, run_id).decision == "FAIL"
