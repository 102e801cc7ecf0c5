"""End to end: the web UI served on a free localhost port, driven by headless Chromium and by ``gradio_client``.

Needs Debian's ``chromium`` and ``chromium-driver`` and the ``selenium`` package (``.ci/install_browser.sh``);
skipped with a reason when they are missing, unless ``EAGLE_REQUIRE_BROWSER=1`` (CI), which makes that a failure.
Screenshots go to test-artifacts/ (git-ignored).
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from pathlib import Path

import pytest
import torch

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from test_webui import FAKE_ANSWER, FakeModel  # noqa: E402  (tests/ is on sys.path, see conftest.py)

pytestmark = pytest.mark.e2e  # the web UI in headless Chromium

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
WAIT_S = 60


def _missing_browser() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "the selenium package is not installed"
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.path.exists(path):
            return f"{path} is missing (apt-get install chromium chromium-driver)"
    return None


_reason = _missing_browser()
if _reason and os.environ.get("EAGLE_REQUIRE_BROWSER") == "1":
    raise RuntimeError(f"browser tests required (EAGLE_REQUIRE_BROWSER=1) but {_reason}; run .ci/install_browser.sh")
needs_browser = pytest.mark.skipif(_reason is not None, reason=f"browser test: {_reason}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(demo) -> str:
    from eagle.application.webui import launch

    port = _free_port()
    launch(demo, host="127.0.0.1", port=port, prevent_thread_lock=True, quiet=True)
    return f"http://127.0.0.1:{port}/"


# ------------------------------------------------------------------------------------------------------ fixtures
MAX_NEW = 32
PROMPTS = ["Hello there", "Tell me a story"]


@pytest.fixture(scope="module")
def real_app(tiny_pair):
    """The UI on a tiny random EaModel (greedy by default), and greedy reference answers computed before serving."""
    from eagle.application.streaming import ChatRunner
    from eagle.application.webui import build_demo
    from eagle.application.worker import ModelWorker
    from eagle.model.ea_model import EaModel

    base_dir, head_dir = tiny_pair
    model = EaModel.from_pretrained(base_model_path=str(base_dir), ea_model_path=str(head_dir), total_token=12,
                                    depth=3, top_k=4)
    runner = ChatRunner(ModelWorker(model))  # only its prompts are used here
    expected = {}
    for text in PROMPTS:  # computed before the server exists: the model is not shared with anyone yet
        ids = runner.prompt([], text).input_ids
        out = model.naivegenerate(torch.tensor([ids]), max_new_tokens=MAX_NEW)[0, len(ids):]
        expected[text] = model.tokenizer.decode(out, skip_special_tokens=True)
    demo = build_demo(model, max_new_tokens=MAX_NEW, temperature=0.0, top_p=0.0, model_name="tiny-llama")
    url = _serve(demo)
    yield url, expected
    demo.close()


@pytest.fixture(scope="module")
def slow_fake_app(tokenizer_for_fake):
    """The UI on a scripted model that takes 30 ms per step: slow enough to press Stop, with known drafts."""
    from eagle.application.webui import build_demo

    model = FakeModel(tokenizer_for_fake, answer=FAKE_ANSWER + " " + "and more words " * 6, delay=0.03)
    demo = build_demo(model, max_new_tokens=400, model_name="scripted")
    url = _serve(demo)
    yield url, model
    demo.close()


@pytest.fixture(scope="module")
def tokenizer_for_fake(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,1100"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(WAIT_S)
    yield driver
    driver.quit()


# --------------------------------------------------------------------------------------------------- page helpers
def _wait(browser, condition, what: str, timeout: float = WAIT_S):
    from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:  # the page re-renders while streaming: an element read a moment ago may be gone, so just poll again
        return WebDriverWait(browser, timeout, poll_frequency=0.1,
                             ignored_exceptions=[StaleElementReferenceException]).until(lambda _: condition())
    except TimeoutException:
        ARTIFACTS.mkdir(exist_ok=True)
        browser.save_screenshot(str(ARTIFACTS / "webui_failure.png"))
        raise AssertionError(f"timed out waiting for {what}; screenshot in test-artifacts/webui_failure.png")


def _by_css(browser, selector):
    from selenium.webdriver.common.by import By

    return browser.find_elements(By.CSS_SELECTOR, selector)


def _open(browser, url):
    browser.get(url)
    _wait(browser, lambda: _by_css(browser, "#eagle-message textarea"), "the page to load")


def _bot_messages(browser, chat="#eagle-chat"):
    return [element.text for element in _by_css(browser, f"{chat} [data-testid=bot]")]


def _box(browser, elem_id) -> str:
    fields = _by_css(browser, f"#{elem_id} input, #{elem_id} textarea")
    return fields[0].get_attribute("value") if fields else ""


def _busy(browser) -> bool:
    trackers = _by_css(browser, "#eagle-chat [data-testid=status-tracker]")
    return any("hide" not in (tracker.get_attribute("class") or "").split() for tracker in trackers)


def _click(browser, elem_id):
    _by_css(browser, f"#{elem_id}")[0].click()


def _send(browser, text):
    box = _by_css(browser, "#eagle-message textarea")[0]
    box.send_keys(text)
    _click(browser, "eagle-send")


def _choose_drafter(browser, label):
    from selenium.webdriver.common.by import By

    browser.find_element(By.XPATH, f"//*[@id='eagle-drafter']//label[contains(., '{label}')]").click()


def _compare(browser, on: bool):
    box = _by_css(browser, "#eagle-compare input")[0]
    if box.is_selected() != on:
        box.click()


def _wait_answer(browser, count: int, what: str):
    _wait(browser, lambda: len(_bot_messages(browser)) >= count and _bot_messages(browser)[-1].strip(), what)
    _wait(browser, lambda: not _busy(browser), f"{what} to finish")


# ----------------------------------------------------------------------------------------------------- the tests
@needs_browser
def test_chat_in_a_real_browser_streams_an_answer_with_speed_figures(real_app, browser):
    url, expected = real_app
    _open(browser, url)
    _click(browser, "eagle-send")  # an empty message: refused with a message, nothing sent to the model
    _wait(browser, lambda: any("message is empty" in t.text for t in _by_css(browser, "[data-testid=toast-text]")),
          "the empty-message warning")
    _send(browser, "x" * 600)  # longer than the tiny model's 512-token context: refused, kept in the box
    _wait(browser, lambda: any("context holds 512 tokens" in t.text
                               for t in _by_css(browser, "[data-testid=toast-text]")), "the too-long warning")
    assert _bot_messages(browser) == []
    _by_css(browser, "#eagle-message textarea")[0].clear()

    _send(browser, PROMPTS[0])
    _wait_answer(browser, 1, "the streamed answer")
    assert _by_css(browser, "#eagle-chat [data-testid=user]")[0].text == PROMPTS[0]
    assert _box(browser, "eagle-speed").endswith("tokens/s") and float(_box(browser, "eagle-speed").split()[0]) > 0
    assert float(_box(browser, "eagle-tokens-per-step")) >= 1.0
    assert float(_box(browser, "eagle-accepted")) >= 0.0
    shown = _bot_messages(browser)[-1]
    assert shown.split()[0] in expected[PROMPTS[0]]  # rendered as Markdown, so compare loosely; exact text: API test
    ARTIFACTS.mkdir(exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "webui_chat.png"))

    _click(browser, "eagle-regenerate")  # greedy: the same answer again, still one exchange
    _wait(browser, lambda: _busy(browser) or _bot_messages(browser) == [shown], "regeneration to start")
    _wait(browser, lambda: not _busy(browser) and len(_bot_messages(browser)) == 1, "the regenerated answer")
    assert _bot_messages(browser) == [shown]

    _click(browser, "eagle-clear")
    _wait(browser, lambda: not _bot_messages(browser) and not _box(browser, "eagle-speed"), "an empty chat")


@needs_browser
def test_stop_keeps_the_partial_answer_and_the_model_keeps_working(slow_fake_app, browser):
    url, model = slow_fake_app
    full = model.tokenizer.decode(model.answer_ids, skip_special_tokens=True)
    _open(browser, url)
    _choose_drafter(browser, "none (plain decoding)")  # one token per 30 ms step: a few seconds in all
    _send(browser, "Say a lot")
    _wait(browser, lambda: len("".join(_bot_messages(browser))) >= 5, "the first tokens")
    assert not _by_css(browser, "#eagle-message textarea")[0].is_enabled()  # one answer at a time
    assert not _by_css(browser, "#eagle-send")[0].is_enabled()
    _click(browser, "eagle-stop")
    _wait(browser, lambda: not _busy(browser), "the stopped answer")
    stopped = _bot_messages(browser)[-1]
    time.sleep(0.3)
    assert _bot_messages(browser)[-1] == stopped and 5 <= len(stopped) < len(full)

    _choose_drafter(browser, "eagle3")
    _send(browser, "Again")
    _wait_answer(browser, 2, "an answer after Stop")
    marks = _by_css(browser, "#eagle-chat [data-testid=bot] mark.eagle-draft")
    assert marks and all(mark.get_attribute("textContent").strip() for mark in marks)  # drafts highlighted
    assert float(_box(browser, "eagle-tokens-per-step")) > 2  # the script accepts 1-3 drafts per step

    _choose_drafter(browser, "eagle3")
    _compare(browser, True)
    _send(browser, "Compare")
    _wait(browser, lambda: "x" in _box(browser, "eagle-speedup") and not _busy(browser), "the comparison")
    # the speed-up figure is shown (its value is timing: benchmarks measure it, tests do not); both sides answered
    # the same text, the plain side without highlighted drafts
    assert float(_box(browser, "eagle-speedup").split("x")[0]) >= 0
    plain_answers = _bot_messages(browser, "#eagle-plain-chat")
    assert len(plain_answers) == 1 and not _by_css(browser, "#eagle-plain-chat mark")
    assert plain_answers[0] == _bot_messages(browser)[-1]
    browser.save_screenshot(str(ARTIFACTS / "webui_compare.png"))

    # Clear while an answer streams: the chat empties and stays empty, with no error shown; the next answer works.
    _compare(browser, False)
    _choose_drafter(browser, "none (plain decoding)")
    delay, model.delay = model.delay, 0.2  # 8 s in all: still streaming when Clear is pressed, even on a busy machine
    try:
        _send(browser, "Say a lot")
        _wait(browser, lambda: len(_bot_messages(browser)) == 4, "the next answer to start")
        assert _busy(browser)
        _click(browser, "eagle-clear")
    finally:
        model.delay = delay
    _wait(browser, lambda: not _busy(browser) and not _bot_messages(browser), "the chat cleared while streaming")
    time.sleep(0.3)
    assert not _bot_messages(browser) and not _by_css(browser, "#eagle-chat .error")
    _send(browser, "After clearing")
    _wait_answer(browser, 1, "an answer after Clear")
    assert _bot_messages(browser)[-1].startswith("Hello!") and _bot_messages(browser)[-1].endswith(
        "and more words")  # the whole answer (rendered as Markdown, so not compared exactly)


def test_gradio_client_streams_greedy_answers_equal_to_plain_decoding(real_app):
    from gradio_client import Client

    url, expected = real_app
    client = Client(url, verbose=False, analytics_enabled=False, download_files=False)
    job = client.submit(PROMPTS[0], [], "eagle3", 0.0, 0.0, 0, MAX_NEW, api_name="/generate")
    final = job.result(timeout=WAIT_S)
    assert final["finished"] and final["text"] == expected[PROMPTS[0]]
    assert final["new_tokens"] >= 1 and final["tokens_per_second"] > 0 and final["tokens_per_step"] >= 1
    assert len(job.outputs()) >= 2  # streamed: updates while generating, then the finished answer

    # Two clients at once are queued, not interleaved on the shared KV cache: each gets its own greedy answer.
    jobs = [client.submit(text, [], mode, 0.0, 0.0, 0, MAX_NEW, api_name="/generate")
            for text, mode in zip(PROMPTS * 2, ["eagle3", "none", "none", "eagle3"])]
    assert [job.result(timeout=WAIT_S)["text"] for job in jobs] == [expected[text] for text in PROMPTS * 2]


def test_gradio_client_cancel_then_the_model_still_answers_correctly(real_app):
    from gradio_client import Client

    url, expected = real_app
    client = Client(url, verbose=False, analytics_enabled=False, download_files=False)
    job = client.submit(PROMPTS[1], [], "eagle3", 0.9, 0.9, 0, 400, api_name="/generate")
    _wait_for(lambda: job.outputs() or job.done(), "the first streamed update")
    job.cancel()
    final = client.predict(PROMPTS[1], [], "eagle3", 0.0, 0.0, 0, MAX_NEW, api_name="/generate")
    assert final["text"] == expected[PROMPTS[1]]


def test_gradio_client_gets_clear_errors_for_bad_input(real_app):
    from gradio_client import Client
    from gradio_client.exceptions import AppError

    url, _ = real_app
    client = Client(url, verbose=False, analytics_enabled=False, download_files=False)
    with pytest.raises(AppError, match="message is empty"):
        client.predict("  ", [], "eagle3", 0.0, 0.0, 0, 8, api_name="/generate")
    with pytest.raises(AppError, match="context holds 512 tokens"):
        client.predict("x" * 600, [], "eagle3", 0.0, 0.0, 0, 8, api_name="/generate")
    with pytest.raises(AppError, match="Unknown drafter 'fast'"):
        client.predict("Hi", [], "fast", 0.0, 0.0, 0, 8, api_name="/generate")


def _wait_for(condition, what: str, timeout: float = WAIT_S):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_demo_py_serves_the_chat_on_localhost_only(real_app, tiny_pair):
    import subprocess
    import sys
    import urllib.request

    from gradio_client import Client

    _, expected = real_app
    base_dir, head_dir = tiny_pair
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", GRADIO_ANALYTICS_ENABLED="False")
    log = ARTIFACTS / "demo_py.log"
    ARTIFACTS.mkdir(exist_ok=True)
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, "demo.py", "--base-model", str(base_dir), "--eagle-model",
                                   str(head_dir), "--port", str(port), "--total-token", "8",
                                   "--max-new-token", str(MAX_NEW)],
                                  cwd=Path(__file__).resolve().parents[1], env=env, stdout=out,
                                  stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}/"

        def up():
            if server.poll() is not None:
                raise AssertionError(f"demo.py exited with {server.returncode}: {log.read_text()[-2000:]}")
            try:
                return urllib.request.urlopen(url, timeout=2).status == 200
            except OSError:
                return False

        _wait_for(up, "demo.py to serve", timeout=150)
        client = Client(url, verbose=False, analytics_enabled=False, download_files=False)
        final = client.predict(PROMPTS[0], [], "eagle3", 0.0, 0.0, 0, MAX_NEW, api_name="/generate")
        assert final["text"] == expected[PROMPTS[0]]
    finally:
        server.terminate()
        server.wait(timeout=30)
    output = log.read_text()
    assert f"http://127.0.0.1:{port}" in output and "gradio.live" not in output
