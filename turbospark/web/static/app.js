// The page: five views behind tabs (arrow keys move between them), one live status feed.
import { followStatus } from "./api.js";
import { startPlayground } from "./playground.js";
import { startStatus } from "./status.js";
import { startModels } from "./models.js";
import { startMic } from "./mic.js";
import { startTalk } from "./talk.js";
import { startImages } from "./images.js";

const tabs = [...document.querySelectorAll('[role="tab"]')];

function select(tab, focus = true) {
  for (const t of tabs) {
    const on = t === tab;
    t.setAttribute("aria-selected", String(on));
    t.tabIndex = on ? 0 : -1;
    document.getElementById(t.getAttribute("aria-controls")).hidden = !on;
  }
  if (focus) tab.focus();
  history.replaceState(null, "", `#${tab.id.slice(4)}`);
  tab.dispatchEvent(new CustomEvent("shown", { bubbles: true }));
}

tabs.forEach((tab, i) => {
  tab.addEventListener("click", () => select(tab));
  tab.addEventListener("keydown", (e) => {
    const step = { ArrowRight: 1, ArrowLeft: -1 }[e.key];
    if (step) { e.preventDefault(); select(tabs[(i + step + tabs.length) % tabs.length]); }
    if (e.key === "Home") { e.preventDefault(); select(tabs[0]); }
    if (e.key === "End") { e.preventDefault(); select(tabs[tabs.length - 1]); }
  });
});

const wanted = document.getElementById(`tab-${location.hash.slice(1)}`);
if (wanted) select(wanted, false);

startPlayground();
startStatus();
startModels();
startMic();
startTalk();
startImages();
followStatus(document.getElementById("feed-state"));
