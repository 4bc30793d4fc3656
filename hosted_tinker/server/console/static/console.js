// Every console page: times shown in the reader's own zone, and confirmations before forms
// that destroy something (data-confirm).
"use strict";

document.querySelectorAll("time[data-unix]").forEach((el) => {
  const t = Number(el.dataset.unix);
  if (t > 0) {
    el.title = el.textContent;
    el.textContent = new Date(t * 1000).toLocaleString();
  }
});

document.querySelectorAll("form[data-confirm]").forEach((form) => {
  form.addEventListener("submit", (event) => {
    if (!window.confirm(form.dataset.confirm)) event.preventDefault();
  });
});
