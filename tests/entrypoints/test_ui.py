"""The chat page (/) and the dashboard (/dashboard) of `pagellm serve`, driven in headless
Chromium through Selenium against a real server on the default model (with an API key):
a reply streams and equals the API's greedy answer, Stop aborts the request in the engine,
untrusted markup stays text, the page asks for the key, the dashboard follows 16 requests,
and both pages fit 1280x800 without console errors (screenshots in tests/results/ui/)."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.entrypoints.openai.conftest import API_KEY, ServerProcess

pytestmark = pytest.mark.slow

RESULTS = Path(__file__).resolve().parents[1] / "results" / "ui"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def wait_for(condition: Callable[[], Any], timeout: float = 60, what: str = "condition") -> Any:
    """Polls until condition() is truthy and returns it; fails naming `what` after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def server(default_model_path) -> Iterator[ServerProcess]:
    srv = ServerProcess()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def model(server) -> str:
    return httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def browser(tmp_path_factory) -> Iterator[Any]:
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("Chromium and chromedriver are not installed (bash scripts/install.sh --test installs them)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")  # never let Selenium Manager look for drivers
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--no-first-run", "--disable-extensions"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": 1280, "height": 800, "deviceScaleFactor": 1, "mobile": False})
    driver.execute_cdp_cmd("Browser.grantPermissions", {"permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"]})
    driver.downloads = tmp_path_factory.mktemp("downloads")
    driver.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(driver.downloads)})
    yield driver
    driver.quit()


def open_page(driver: Any, server: ServerProcess, path: str = "/", key: str | None = API_KEY,
              settings: dict | None = None, storage: dict | None = None) -> None:
    """Opens `path` with a fresh local storage holding `key`, `settings` and `storage`; the
    storage is set from a static asset of the same origin, so the page never starts without it."""
    driver.get(server.url + "/ui/pagellm.css")
    items = dict(storage or {})
    if key is not None:
        items["pagellm.apiKey"] = key
    if settings is not None:
        items["pagellm.settings"] = json.dumps(settings)
    driver.execute_script("localStorage.clear(); for (const [k, v] of Object.entries(arguments[0])) localStorage.setItem(k, v);", items)
    driver.get_log("browser")  # start each page with an empty console record
    driver.get(server.url + path)


def console_errors(driver: Any) -> list[dict]:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def check_layout_and_screenshot(driver: Any, name: str) -> None:
    """No console errors, nothing wider than the 1280 px viewport, a screenshot saved."""
    assert console_errors(driver) == []
    width, client = driver.execute_script(
        "return [document.documentElement.scrollWidth, document.documentElement.clientWidth]")
    assert client == 1280 and width <= client
    RESULTS.mkdir(parents=True, exist_ok=True)
    assert driver.save_screenshot(str(RESULTS / f"{name}.png"))


def last_reply_state(driver: Any) -> str | None:
    return driver.execute_script(
        "const a = document.querySelectorAll('#messages article.assistant');"
        "return a.length ? a[a.length - 1].dataset.state : null;")


def wait_reply_done(driver: Any, timeout: float = 240) -> dict:
    wait_for(lambda: last_reply_state(driver) in ("done", "stopped", "error"), timeout, "the reply to end")
    return stored_conversation(driver)["messages"][-1]


def stored_conversation(driver: Any) -> dict:
    return driver.execute_script(
        "const all = JSON.parse(localStorage.getItem('pagellm.conversations'));"
        "return all.find(c => c.id === localStorage.getItem('pagellm.current'));")


def send_message(driver: Any, text: str) -> None:
    from selenium.webdriver.common.by import By

    wait_for(lambda: driver.find_element(By.ID, "send").is_displayed(), 30, "the send button")
    box = driver.find_element(By.ID, "input")
    box.clear()
    box.send_keys(text)
    driver.find_element(By.ID, "send").click()


def record_frames(driver: Any) -> None:
    """Records, for each DOM update of the last reply, its state and text length."""
    driver.execute_script("""
        window.__frames = [];
        new MutationObserver(() => {
            const a = document.querySelectorAll('#messages article.assistant');
            if (!a.length) return;
            const last = a[a.length - 1];
            window.__frames.push([last.dataset.state, last.querySelector('.content').textContent.length,
                                  last.querySelector('.reading').hidden ? '' : last.querySelector('.reading').textContent]);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true, attributes: true});
    """)


def live_read(driver: Any, css: str, attribute: str | None = None) -> str:
    """The text (or `attribute`) of a dashboard element that each poll redraws, read in one
    script call: a Selenium element found first can be replaced by the next poll before it
    is read."""
    return driver.execute_script(
        "const e = document.querySelector(arguments[0]);"
        " return arguments[1] === null ? e.innerText : e.getAttribute(arguments[1])", css, attribute)


def engine_metric(server: ServerProcess, name: str, reason: str | None = None) -> float:
    total = 0.0
    for key, value in server.metrics().items():
        if key.startswith(name + "{") and (reason is None or f'finished_reason="{reason}"' in key):
            total += value
    return total


def test_pages_are_served_without_a_key(server) -> None:
    for path, kind in (("/", "text/html"), ("/dashboard", "text/html"), ("/ui/chat.js", "javascript"),
                       ("/ui/dashboard.js", "javascript"), ("/ui/markdown.js", "javascript"),
                       ("/ui/pagellm.css", "text/css"), ("/favicon.ico", "image/png")):
        r = httpx.get(server.url + path)
        assert r.status_code == 200 and kind in r.headers["content-type"], path
    assert httpx.get(server.url + "/favicon.ico").content[:8] == b"\x89PNG\r\n\x1a\n"
    assert httpx.get(server.url + "/v1/models").status_code == 401  # the API keeps its key


def test_reply_streams_and_equals_the_api(server, model, browser) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    open_page(browser, server)
    wait_for(lambda: browser.find_element(By.ID, "model-name").text == model, 30, "the model name")
    for field, value in (("temperature", "0"), ("max-tokens", "96")):
        box = browser.find_element(By.ID, field)
        box.send_keys(Keys.CONTROL, "a")
        box.send_keys(value + "\t")  # tab: the change event stores it
    assert json.loads(browser.execute_script("return localStorage.getItem('pagellm.settings')"))["temperature"] == 0
    record_frames(browser)
    question = "Write a Python function that adds two numbers."
    send_message(browser, question)
    reply = wait_reply_done(browser)
    assert "error" not in reply and "stopped" not in reply

    expected = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": question}],
        "temperature": 0, "top_p": 1, "max_tokens": 96}).json()
    assert reply["content"] == expected["choices"][0]["message"]["content"]
    assert reply["stats"]["tokens"] == expected["usage"]["completion_tokens"]

    frames = browser.execute_script("return window.__frames")
    states = [state for state, _, _ in frames]
    assert states.index("reading") < states.index("streaming") < states.index("done")
    assert any(text.startswith("Reading the prompt") for state, _, text in frames if state == "reading")
    final = [n for state, n, _ in frames if state == "done"][-1]
    partial = sorted({n for state, n, _ in frames if state == "streaming" and 0 < n < final})
    assert len(partial) >= 2  # the text grew over at least two frames before it ended
    stats = browser.find_element(By.CSS_SELECTOR, "#messages article.assistant .stats").text
    cut = " · max tokens reached" if expected["choices"][0]["finish_reason"] == "length" else ""
    assert re.fullmatch(rf"{reply['stats']['tokens']} tokens · TTFT \d+\.\d\d s · \d+\.\d tokens/s{cut}", stats)
    assert reply["finish"] == expected["choices"][0]["finish_reason"]
    check_layout_and_screenshot(browser, "chat")


def test_regenerate_and_edit_last(server, browser) -> None:
    from selenium.webdriver.common.by import By

    open_page(browser, server, settings={"system": "", "temperature": 0, "top_p": 1, "max_tokens": 8})
    send_message(browser, "Say hello.")
    first = wait_reply_done(browser)
    browser.find_element(By.ID, "regenerate").click()  # replaces the reply at once, then streams
    again = wait_reply_done(browser)
    conv = stored_conversation(browser)
    assert [m["role"] for m in conv["messages"]] == ["user", "assistant"]
    assert again["content"] == first["content"]  # greedy: the same reply, replacing the old one
    browser.find_element(By.ID, "edit-last").click()
    assert browser.find_element(By.ID, "input").get_attribute("value") == "Say hello."
    assert stored_conversation(browser)["messages"] == []


def test_stop_aborts_the_request_in_the_engine(server, browser) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    open_page(browser, server, settings={"system": "", "temperature": 0, "top_p": 1, "max_tokens": 900})
    aborts = engine_metric(server, "pagellm:request_success_total", "abort")
    send_message(browser, "Write a very long story about a dragon who learns to bake bread.")
    wait_for(lambda: last_reply_state(browser) == "streaming", 120, "the first tokens")
    assert engine_metric(server, "pagellm:num_requests_running") == 1
    browser.find_element(By.ID, "stop").click()
    reply = wait_reply_done(browser)
    assert reply.get("stopped") is True and "error" not in reply
    assert browser.find_element(By.CSS_SELECTOR, "#messages article.assistant .stats").text.startswith("stopped")
    wait_for(lambda: engine_metric(server, "pagellm:request_success_total", "abort") == aborts + 1, 30,
             "the engine to count the abort")
    wait_for(lambda: engine_metric(server, "pagellm:num_requests_running") == 0, 30, "no running request")
    assert engine_metric(server, "pagellm:kv_cache_usage_perc") == 0.0
    assert browser.find_element(By.ID, "send").is_displayed()
    assert not browser.find_element(By.ID, "stop").is_displayed()
    box = browser.find_element(By.ID, "max-tokens")
    box.send_keys(Keys.CONTROL, "a")
    box.send_keys("16\t")
    send_message(browser, "Hi")  # the page takes a new message and answers it
    reply = wait_reply_done(browser)
    assert "error" not in reply and "stopped" not in reply and reply["stats"]["tokens"] <= 16
    assert [m["role"] for m in stored_conversation(browser)["messages"]] == ["user", "assistant"] * 2


MARKUP = "<script>window.__pwned = 'script'</script> and <img src=x onerror=\"window.__pwned = 'img'\">"


def test_untrusted_markup_is_shown_as_text(server, browser, tmp_path) -> None:
    """A model cannot be made to emit this on demand, so the reply arrives in an imported
    conversation (the same renderer draws streamed replies and stored ones); the user's own
    message, the title and the folded reasoning carry it too."""
    from selenium.webdriver.common.by import By

    reply = (f"Plain {MARKUP}\n**bold {MARKUP}** and `{MARKUP}`\n"
             f"```html\n{MARKUP}\n```\n"
             "[a link](javascript:window.__pwned='link') and [a real one](https://example.com/x)")
    conversation = {"format": "pagellm.conversations", "version": 1, "conversations": [{
        "id": "xss", "title": MARKUP, "messages": [
            {"role": "user", "content": MARKUP},
            {"role": "assistant", "content": reply, "reasoning": MARKUP, "stats": {"tokens": 7}},
        ]}]}
    path = tmp_path / "conversation.json"
    path.write_text(json.dumps(conversation))
    open_page(browser, server)
    browser.find_element(By.ID, "import-file").send_keys(str(path))
    wait_for(lambda: browser.find_element(By.ID, "import-status").text == "Imported 1 conversation.", 10, "the import")
    time.sleep(1)  # an injected <img src=x> would have failed to load and run onerror by now
    assert browser.execute_script("return window.__pwned") is None
    assert browser.execute_script("return document.querySelectorAll('#messages img, #messages script, "
                                  "#conversation-list img, #conversation-list script').length") == 0
    assistant = browser.find_element(By.CSS_SELECTOR, "#messages article.assistant")
    content = assistant.find_element(By.CSS_SELECTOR, ".content")
    assert content.find_element(By.CSS_SELECTOR, "p").text.startswith(f"Plain {MARKUP}")
    assert content.find_element(By.CSS_SELECTOR, "strong").text == f"bold {MARKUP}"
    assert content.find_element(By.CSS_SELECTOR, "p code").text == MARKUP
    assert content.find_element(By.CSS_SELECTOR, "pre code.language-html").text == MARKUP
    links = content.find_elements(By.CSS_SELECTOR, "a")
    assert [a.get_attribute("href") for a in links] == ["https://example.com/x"]
    assert "[a link](javascript:window.__pwned='link')" in content.text
    user = browser.find_element(By.CSS_SELECTOR, "#messages article.user .content")
    assert user.text == MARKUP
    assert browser.find_element(By.CSS_SELECTOR, "#conversation-list .open-conversation").text == MARKUP[:80]
    reasoning = assistant.find_element(By.CSS_SELECTOR, "details.reasoning")
    assert reasoning.get_attribute("open") is None  # folded away
    assert reasoning.find_element(By.CSS_SELECTOR, ".reasoning-text").get_attribute("textContent") == MARKUP
    assert console_errors(browser) == []


def test_markdown_rendering(server, browser) -> None:
    open_page(browser, server)
    html = browser.execute_script("""
        const div = document.createElement('div');
        window.pagellmMarkdown.renderMarkdown(arguments[0], div);
        return div.innerHTML;""",
        "## Title\n\nLine one\nline *two* and __three__\n\n- a\n- `b`\n\n3. c\n4. d\n\n> quoted\n\n---\n```py\nx = 1 < 2\n")
    assert html == (
        '<h4 class="md-heading">Title</h4><p>Line one<br>line <em>two</em> and <strong>three</strong></p>'
        '<ul><li>a</li><li><code>b</code></li></ul><ol start="3"><li>c</li><li>d</li></ol>'
        '<blockquote><p>quoted</p></blockquote><hr>'
        '<div class="code-block"><div class="code-bar"><span class="code-lang">py</span>'
        '<button class="copy-code" type="button">copy</button></div>'
        '<pre><code class="language-py">x = 1 &lt; 2</code></pre></div>')


def test_export_then_import_round_trips(server, browser) -> None:
    from selenium.webdriver.common.by import By

    conversations = [
        {"id": "a", "title": "first", "created": 1, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello", "stats": {"tokens": 2, "ttft": 0.5, "tps": 10.0}}]},
        {"id": "b", "title": "second", "created": 2, "messages": [{"role": "user", "content": "x"}]},
    ]
    open_page(browser, server, storage={"pagellm.conversations": json.dumps(conversations), "pagellm.current": "a"})
    for old in browser.downloads.glob("*"):
        old.unlink()
    browser.find_element(By.ID, "export").click()
    files = wait_for(lambda: [p for p in browser.downloads.glob("pagellm-conversations-*.json")], 20, "the download")
    exported = json.loads(files[0].read_text())
    assert exported["format"] == "pagellm.conversations" and exported["conversations"] == conversations
    open_page(browser, server)
    browser.find_element(By.ID, "import-file").send_keys(str(files[0]))
    wait_for(lambda: browser.find_element(By.ID, "import-status").text == "Imported 2 conversations.", 10, "the import")
    stored = json.loads(browser.execute_script("return localStorage.getItem('pagellm.conversations')"))
    assert stored == conversations
    titles = [b.text for b in browser.find_elements(By.CSS_SELECTOR, "#conversation-list .open-conversation")]
    assert titles == ["first", "second"]
    copy = browser.find_element(By.CSS_SELECTOR, "#messages article.assistant .copy-reply")
    copy.click()
    wait_for(lambda: copy.text == "Copied", 10, "the copy")
    assert browser.execute_async_script(
        "navigator.clipboard.readText().then(arguments[0], e => arguments[0]('error: ' + e))") == "hello"


def test_server_errors_show_in_the_reply(server, model, browser) -> None:
    from selenium.webdriver.common.by import By

    open_page(browser, server, settings={"system": "Be brief.", "temperature": 0, "top_p": 1, "max_tokens": 5000})
    send_message(browser, "Hi")
    reply = wait_reply_done(browser, timeout=60)
    expected = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, json={
        "model": model, "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "max_tokens": 5000})
    assert expected.status_code == 400
    message = expected.json()["error"]["message"]
    assert message.startswith("'max_tokens' is too large: 5000.")
    assert reply["error"] == message and reply["content"] == ""
    assert browser.find_element(By.CSS_SELECTOR, "#messages article.assistant .error").text == message
    assert last_reply_state(browser) == "error"


def test_api_key_is_asked_for_then_used(server, model, browser) -> None:
    from selenium.webdriver.common.by import By

    def dialog_error() -> str | None:
        open_ = browser.execute_script("return document.getElementById('key-dialog').open")
        return browser.find_element(By.ID, "key-error").text if open_ else None

    def enter_key(key: str) -> None:
        box = browser.find_element(By.ID, "key-input")
        box.clear()
        box.send_keys(key)
        browser.find_element(By.ID, "key-submit").click()

    open_page(browser, server, key=None, settings={"system": "", "temperature": 0, "top_p": 1, "max_tokens": 8})
    # The page loaded without a key; its first API call got 401 and the server's message.
    assert wait_for(dialog_error, 30, "the key dialog") == "Invalid or missing API key."
    enter_key("sk-wrong")
    wait_for(lambda: dialog_error() == "The key was refused: Invalid or missing API key.", 30, "the refusal")
    enter_key(API_KEY)
    wait_for(lambda: browser.find_element(By.ID, "model-name").text == model, 30, "the model name")
    assert dialog_error() is None
    assert browser.execute_script("return localStorage.getItem('pagellm.apiKey')") == API_KEY
    send_message(browser, "Hi")
    reply = wait_reply_done(browser)
    assert "error" not in reply and reply["content"] and dialog_error() is None  # not asked again


def test_dashboard_follows_16_requests(server, model, browser) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    def series(metric: str) -> list[list[float]]:
        return browser.execute_script("return window.pagellmDashboard.series[arguments[0]]['0'] || []", metric)

    open_page(browser, server, path="/dashboard")
    wait_for(lambda: browser.execute_script("return window.pagellmDashboard.polls") >= 2, 30, "two polls")
    assert browser.execute_script("return window.pagellmDashboard.intervalMs") == 1000
    assert browser.execute_script("return window.pagellmDashboard.engines") == ["0"]

    def one(i: int) -> int:
        r = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=300, json={
            "model": model, "prompt": f"Request {i}: tell me a story.", "max_tokens": 96, "ignore_eos": True})
        return r.json()["usage"]["completion_tokens"]

    with ThreadPoolExecutor(16) as pool:
        started = time.time() * 1000
        futures = [pool.submit(one, i) for i in range(16)]
        wait_for(lambda: any(v > 0 for t, v in series("running") if t >= started), 120, "running requests on the plot")
        wait_for(lambda: any(v > 0 for t, v in series("kv_cache_usage_perc") if t >= started), 60, "KV usage on the plot")
        assert [f.result() for f in futures] == [96] * 16
    running = [v for t, v in series("running") if t >= started]
    assert 0 < max(running) <= 16
    assert any(v is not None and v > 0 for t, v in series("generation_tokens_per_s") if t >= started)
    wait_for(lambda: series("running")[-1][1] == 0 and series("kv_cache_usage_perc")[-1][1] == 0, 30,
             "the plots to fall back to zero")
    latest = json.loads(live_read(browser, "#chart-requests", "data-latest"))
    assert latest == {"running": 0, "waiting": 0}
    assert json.loads(live_read(browser, "#chart-kv", "data-latest")) == {"usage": 0}
    assert live_read(browser, "#tile-finished .value") != "0"
    Select(browser.find_element(By.ID, "window")).select_by_value("60")  # the burst, readable
    check_layout_and_screenshot(browser, "dashboard")


def test_dashboard_plots_speculative_acceptance(browser) -> None:
    """A server with n-gram speculation: a streamed completion of a repeating prompt is the
    greedy text of the offline engine without it, and the dashboard plots the share of
    proposals accepted (the vllm:spec_decode counters)."""
    from pagellm import LLM, SamplingParams

    prompt = "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,"
    want = LLM(multiprocess_mode=False, max_model_len=1024).generate(
        prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    srv = ServerProcess("--speculative-config", json.dumps(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3}))
    try:
        open_page(browser, srv, path="/dashboard")
        wait_for(lambda: browser.execute_script("return window.pagellmDashboard.polls") >= 2, 30, "two polls")
        text = ""
        with httpx.stream("POST", srv.url + "/v1/completions", headers=AUTH, timeout=120, json={
                "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        assert text == want
        metrics = httpx.get(srv.url + "/metrics").text
        accepted = float(re.search(r'^vllm:spec_decode_num_accepted_tokens_total\{[^}]*\} (\S+)', metrics, re.M).group(1))
        assert accepted > 0

        def plotted() -> list:
            return browser.execute_script(
                "return (window.pagellmDashboard.series['spec_acceptance_perc']['0'] || []).map(p => p[1])")
        wait_for(lambda: any(v is not None and 0 < v <= 100 for v in plotted()), 30, "the acceptance plot")
    finally:
        srv.stop()


def test_disable_ui_leaves_the_api_only(tiny_model) -> None:
    srv = ServerProcess(tiny_model("llama"), "--max-model-len", "256", "--disable-ui")
    try:
        for path in ("/", "/dashboard", "/ui/chat.js"):
            assert httpx.get(srv.url + path).status_code == 404, path
        assert httpx.get(srv.url + "/v1/models", headers=AUTH).status_code == 200
        assert httpx.get(srv.url + "/metrics").status_code == 200
    finally:
        srv.stop()


def test_dashboard_percentiles_from_histogram_buckets(server, browser) -> None:
    open_page(browser, server, path="/dashboard")
    wait_for(lambda: browser.execute_script("return window.pagellmDashboard.quantile !== undefined"), 10, "the page")
    q = lambda p, now, before=None: browser.execute_script(  # noqa: E731
        "return window.pagellmDashboard.quantile(arguments[0], arguments[1], arguments[2])", p, now, before)
    inf = "Infinity"  # JSON has no infinity: the test sends buckets keyed as the page keys them
    now = {"0.1": 10, "0.5": 30, "1": 40, inf: 40}  # cumulative: 10 in (0, 0.1], 20 in (0.1, 0.5], 10 in (0.5, 1]
    assert q(0.25, now) == 0.1  # rank 10 ends the first bucket
    assert q(0.5, now) == pytest.approx(0.1 + 0.4 * 10 / 20)  # rank 20: half-way through (0.1, 0.5]
    assert q(1.0, now) == 1.0
    assert q(0.5, now, {"0.1": 10, "0.5": 10, "1": 10, inf: 10}) == pytest.approx(0.1 + 0.4 * 15 / 20)  # window deltas
    assert q(0.5, now, now) is None  # nothing observed in the window
    assert q(0.99, {"0.1": 0, inf: 5}) == 0.1  # beyond the last finite bucket: its bound


def test_dashboard_plots_each_engine_and_marks_preemptions(tiny_model, browser) -> None:
    """Two data-parallel engines with a KV cache too small for their batch: the dashboard
    has a series per engine and marks the preemptions the engines count."""
    srv = ServerProcess(tiny_model("llama"), "--max-model-len", "256", "--data-parallel-size", "2",
                        "--num-gpu-blocks-override", "24")
    try:
        open_page(browser, srv, path="/dashboard")
        wait_for(lambda: browser.execute_script("return window.pagellmDashboard.polls") >= 2, 30, "two polls")
        assert browser.execute_script("return window.pagellmDashboard.engines") == ["0", "1"]
        assert set(browser.execute_script("return Object.keys(window.pagellmDashboard.series.running)")) == {"0", "1"}
        legend = live_read(browser, "#chart-requests .legend")
        for name in ("running · engine 0", "running · engine 1", "waiting · engine 0", "waiting · engine 1"):
            assert name in legend

        def one(i: int) -> int:
            r = httpx.post(srv.url + "/v1/completions", headers=AUTH, timeout=300, json={
                "prompt": f"Story {i}:", "max_tokens": 200, "ignore_eos": True})
            return r.json()["usage"]["completion_tokens"]

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(one, range(8))) == [200] * 8
        preempted = engine_metric(srv, "pagellm:num_preemptions_total")
        assert preempted > 0
        def preemption_markers() -> list[dict]:
            return browser.execute_script(
                "return window.pagellmDashboard.markers.filter(m => m.kind === 'preemption')")

        # the page polls every few seconds: wait for the poll that has seen every preemption
        wait_for(lambda: sum(m["count"] for m in preemption_markers()) == preempted, 30,
                 f"preemption markers counting {preempted:.0f}")
        markers = preemption_markers()
        assert sum(m["count"] for m in markers) == preempted
        assert {m["engine"] for m in markers} <= {"0", "1"}
        assert live_read(browser, "#tile-preemptions .value") == f"{preempted:.0f}"
        assert console_errors(browser) == []
    finally:
        srv.stop()


def test_dashboard_marks_a_restart(tiny_model, browser, monkeypatch) -> None:
    """The server goes away and a new one starts on the same port: the page reports the gap
    and marks a restart where the counters went back to zero."""
    import tests.entrypoints.openai.conftest as server_conftest

    model = tiny_model("llama")
    first = ServerProcess(model, "--max-model-len", "256")
    try:
        open_page(browser, first, path="/dashboard")
        r = httpx.post(first.url + "/v1/completions", headers=AUTH, json={"prompt": "Hi", "max_tokens": 4})
        assert r.status_code == 200
        wait_for(lambda: browser.execute_script(
            "const s = window.pagellmDashboard.snapshots; return s.length && s[s.length - 1].engines['0'].generation > 0"),
            30, "the dashboard to see the first server's tokens")
    finally:
        first.stop()
    wait_for(lambda: browser.execute_script("return window.pagellmDashboard.lastError"), 30, "the gap")
    assert browser.find_element("id", "status").text.startswith("Cannot read /metrics")
    monkeypatch.setattr(server_conftest, "_free_port", lambda: first.port)
    second = ServerProcess(model, "--max-model-len", "256")
    try:
        markers = wait_for(lambda: browser.execute_script(
            "return window.pagellmDashboard.markers.filter(m => m.kind === 'restart')"), 60, "a restart marker")
        assert [(m["engine"], m["count"]) for m in markers] == [("0", 1)]
        assert browser.execute_script("return window.pagellmDashboard.lastError") is None
    finally:
        second.stop()
