// jaxshard.verify's report page (jaxshard/_verify/html.py): sorts a table on a click
// on its header, filters its rows by the search box above it, and shows every
// array's layout on request. Everything else is plain HTML, drawn without it. The
// root is found by its id: a notebook may run the script with no currentScript.
(function (root) {
  if (!root) return;
  function key(cell) {
    var v = cell.getAttribute("data-sort");
    return v === null ? cell.textContent.trim().toLowerCase() : parseFloat(v);
  }
  function sortBy(table, th) {
    var index = Array.prototype.indexOf.call(th.parentNode.children, th);
    var ascending = th.getAttribute("aria-sort") !== "ascending";
    table.querySelectorAll("th").forEach(function (h) { h.removeAttribute("aria-sort"); });
    th.setAttribute("aria-sort", ascending ? "ascending" : "descending");
    var body = table.tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    rows.sort(function (a, b) {
      var x = key(a.cells[index]), y = key(b.cells[index]);
      var order = typeof x === "number" && typeof y === "number"
        ? x - y : String(x).localeCompare(String(y), undefined, {numeric: true});
      return ascending ? order : -order;
    });
    rows.forEach(function (row) { body.appendChild(row); });
  }
  root.querySelectorAll("table.data").forEach(function (table) {
    table.querySelectorAll("th").forEach(function (th) {
      th.addEventListener("click", function () { sortBy(table, th); });
    });
  });
  root.querySelectorAll("input[data-filter]").forEach(function (input) {
    var table = root.querySelector("#" + input.getAttribute("data-filter"));
    var count = root.querySelector("#" + input.getAttribute("data-filter") + "-count");
    input.addEventListener("input", function () {
      var words = input.value.toLowerCase().split(/\s+/).filter(Boolean);
      var shown = 0, rows = table.tBodies[0].rows;
      for (var i = 0; i < rows.length; i++) {
        var text = rows[i].textContent.toLowerCase();
        var hit = words.every(function (w) { return text.indexOf(w) >= 0; });
        rows[i].classList.toggle("hidden", !hit);
        shown += hit ? 1 : 0;
      }
      if (count) count.textContent = words.length ? shown + " of " + rows.length : rows.length;
    });
  });
  root.querySelectorAll("button[data-more]").forEach(function (button) {
    button.addEventListener("click", function () {
      var hidden = root.querySelectorAll("." + button.getAttribute("data-more"));
      hidden.forEach(function (el) { el.classList.remove("hidden"); });
      button.classList.add("hidden");
    });
  });
})(document.getElementById("__ROOT__"));  // html.py names the root
